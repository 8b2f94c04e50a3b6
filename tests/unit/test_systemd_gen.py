"""dynamod.ops.systemd: unit file generation from a stack (pure; nothing runs)."""

from __future__ import annotations

import itertools
import os
import textwrap
from pathlib import Path

import pytest

from dynamod.core import spec
from dynamod.core.spec import LimitsSpec
from dynamod.ops import systemd
from dynamod.ops.supervisord import ExportError

STACK = """
    [units.etcd]
    command = ["/bin/sleep", "{ports.client}"]
    ports = { client = 0 }
    stop = { timeout = 10 }
    ready = { kind = "http", url = "http://127.0.0.1:{ports.client}/health", deadline = 30 }

    [units.init]
    type = "oneshot"
    command = ["/bin/true"]

    [units.worker]
    replicas = 2
    description = "rollout shard {index}, 100% CPU"
    command = ["sleep", "--name", "a b", "$HOME", "50%", ";", 'say "hi"']
    env = { DYN_SYSTEM_PORT = "{ports.system}", QUOTED = 'x "y" $z 5%' }
    ports = { system = 0 }
    depends_on = { etcd = "ready", init = "completed" }
    restart = { policy = "always", backoff_initial = 0.5, limit_burst = 4, limit_interval = 90 }
    stop = { signal = "SIGINT", timeout = 20.5 }
    ready = { kind = "tcp", port = "{ports.system}", deadline = 60 }
    live = { kind = "log", pattern = "alive" }
    limits = { memory_max = "64M", cpu_quota = "50%" }

    [units.frontend]
    command = ["/bin/sleep", "1"]
    depends_on = ["worker"]
    restart = { policy = "never" }
    ready = { kind = "log", pattern = "listening" }
"""

DYNAMOD = ["/opt/dynamod/bin/dynamod"]


def load(tmp_path: Path, text: str = STACK) -> spec.Stack:
    path = tmp_path / "rollout.toml"
    path.write_text(textwrap.dedent(text))
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter))


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


# ------------------------------------------------------------------------- quoting


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("--port", "--port"),
        ("http://127.0.0.1:2379", "http://127.0.0.1:2379"),
        ("a b", '"a b"'),
        ("", '""'),
        ("50%", '"50%%"'),
        ("$HOME", '"$$HOME"'),
        (";", "\\;"),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("two\nlines\tand\x01", '"two\\nlines\\tand\\x01"'),
    ],
)
def test_exec_arguments_are_quoted_for_systemd(arg: str, quoted: str) -> None:
    assert systemd.quote_arg(arg) == quoted


def test_environment_lines_escape_specifiers_but_not_dollars() -> None:
    assert systemd.environment_line("A", 'x "y" $z 5%') == 'Environment="A=x \\"y\\" $z 5%%"'
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        systemd.environment_line("BAD-NAME", "1")


# ------------------------------------------------------------------------- dynamod@


def test_stack_service_is_a_notify_service_that_stops_in_order(tmp_path: Path) -> None:
    stack = load(tmp_path)
    unit = systemd.stack_service(stack, dynamod=DYNAMOD, variables=["workers=2"], watchdog_sec=20)
    assert unit.name == "dynamod@.service"
    found = settings(unit.text)
    assert found["Type"] == ["notify"]
    assert found["NotifyAccess"] == ["main"]
    assert found["WatchdogSec"] == ["20"]
    assert found["KillMode"] == ["mixed"]
    assert found["Restart"] == ["on-failure"]
    assert found["ExecStart"] == [
        f"/opt/dynamod/bin/dynamod --state-dir /run/dynamod/%i up {stack.path} --var workers=2"
    ]
    assert found["ExecStop"] == ["/opt/dynamod/bin/dynamod --state-dir /run/dynamod/%i down"]
    assert "--detach" not in unit.text
    # every unit's stop timeout (10 + 10 + 20.5 + 20.5 + 10 s) plus the SIGKILL waits
    stop_timeouts = sum(u.stop.timeout for u in stack.units.values())
    assert int(found["TimeoutStopSec"][0]) >= stop_timeouts + 5 * len(stack.units)
    # longest chain of readiness deadlines: etcd (30) -> worker (60) -> frontend (120)
    assert int(found["TimeoutStartSec"][0]) >= 30 + 60 + 120
    assert "# mixed: " in unit.text  # the choice is explained where it is made


def test_stack_service_delegates_its_cgroup(tmp_path: Path) -> None:
    """dynamod contains each unit in a cgroup below the service's: systemd must hand it
    that subtree (Delegate=yes), exactly once, in [Service]."""
    unit = systemd.stack_service(load(tmp_path), dynamod=DYNAMOD, variables=[], watchdog_sec=20)
    assert settings(unit.text)["Delegate"] == ["yes"]
    service = unit.text.split("[Service]", 1)[1].split("[Install]", 1)[0]
    assert "\nDelegate=yes\n" in service


def test_stop_and_start_budgets(tmp_path: Path) -> None:
    stack = load(tmp_path)
    assert systemd.stop_budget(stack) == 10 + 10 + 20.5 + 20.5 + 10 + 5 * 5 + 15
    assert systemd.start_budget(stack) == 30 + 60 + 120 + 60


# ------------------------------------------------------------------------- per unit


def test_per_unit_services_mirror_dependencies_restart_and_stop(tmp_path: Path) -> None:
    stack = load(tmp_path)
    files = {f.name: f.text for f in systemd.per_unit_services(stack, dynamod=DYNAMOD)}
    assert list(files) == [
        "dynamod-etcd.service",
        "dynamod-init.service",
        "dynamod-worker@0.service",
        "dynamod-worker@1.service",
        "dynamod-frontend.service",
        "dynamod-rollout.target",
    ]
    target = settings(files["dynamod-rollout.target"])
    assert target["Wants"] == [" ".join(n for n in files if n.endswith(".service"))]
    assert target["WantedBy"] == ["multi-user.target"]

    worker = settings(files["dynamod-worker@1.service"])
    assert worker["Requires"] == worker["After"] == ["dynamod-etcd.service dynamod-init.service"]
    assert worker["PartOf"] == ["dynamod-rollout.target"]
    assert worker["Description"] == ["rollout shard 1, 100%% CPU (dynamod stack rollout)"]
    assert worker["Type"] == ["exec"]
    assert worker["ExecStart"][0].startswith("/")  # `sleep` resolved to an absolute path
    assert worker["ExecStart"][0].endswith(
        ' --name "a b" "$$HOME" "50%%" \\; "say \\"hi\\""'
    )
    port = stack.units["worker@1"].ports["system"]
    assert f'"DYN_SYSTEM_PORT={port}"' in worker["Environment"]
    assert '"QUOTED=x \\"y\\" $z 5%%"' in worker["Environment"]
    assert worker["Environment"][0].startswith('"PATH=')
    assert worker["KillMode"] == ["control-group"]
    assert worker["KillSignal"] == ["SIGINT"]
    assert worker["TimeoutStopSec"] == ["21"]
    assert worker["Restart"] == ["always"] and worker["RestartSec"] == ["0.5"]
    assert worker["StartLimitBurst"] == ["4"] and worker["StartLimitIntervalSec"] == ["90"]
    # readiness: a tcp probe becomes an ExecStartPost that waits for it
    (post,) = worker["ExecStartPost"]
    assert post.startswith("/opt/dynamod/bin/dynamod systemd wait-ready ")
    assert f'\\"port\\":{port}' in post and '\\"kind\\":\\"tcp\\"' in post
    assert worker["TimeoutStartSec"] == ["70"]

    init = settings(files["dynamod-init.service"])
    assert init["Type"] == ["oneshot"] and init["RemainAfterExit"] == ["yes"]
    assert init["Restart"] == ["on-failure"]
    assert "Requires" not in init

    frontend = settings(files["dynamod-frontend.service"])
    assert frontend["Restart"] == ["no"]
    assert "ExecStartPost" not in frontend  # a log probe needs dynamod reading the output
    assert frontend["Requires"] == ["dynamod-worker@0.service dynamod-worker@1.service"]


def test_a_units_limits_become_systemds_resource_control(tmp_path: Path) -> None:
    limits = LimitsSpec.model_validate(
        {"memory_max": "2G", "memory_high": "1.5G", "cpu_weight": 50, "cpu_quota": "150%",
         "cpuset": str(min(os.sched_getaffinity(0))), "pids_max": 512, "nice": 5}
    )
    assert systemd.resource_control(limits) == [
        f"MemoryMax={2 << 30}", f"MemoryHigh={3 << 29}", "CPUWeight=50", "CPUQuota=150%%",
        f"AllowedCPUs={min(os.sched_getaffinity(0))}", "TasksMax=512", "Nice=5",
    ]
    assert systemd.resource_control(None) == []
    # a nice alone weighs the service's cgroup as the kernel weighs that nice
    assert systemd.resource_control(LimitsSpec.model_validate({"nice": 10})) == [
        "CPUWeight=11", "Nice=10",
    ]
    stack = load(tmp_path)
    files = {f.name: f.text for f in systemd.per_unit_services(stack, dynamod=DYNAMOD)}
    assert "MemoryMax" not in files["dynamod-etcd.service"]  # no limits: none written
    worker = settings(files["dynamod-worker@0.service"])
    assert worker["MemoryMax"] == [str(64 << 20)] and worker["CPUQuota"] == ["50%%"]


def test_per_unit_gaps_name_the_units_concerned(tmp_path: Path) -> None:
    gaps = systemd.per_unit_gaps(load(tmp_path))
    text = "\n".join(gaps)
    assert "liveness probes are not run (a hung worker@0, worker@1 is not restarted)" in text
    assert "log-line readiness probes cannot be waited for (frontend)" in text
    assert "restart backoff" in text
    assert "rejoin" not in text  # no Dynamo workers in this stack


def test_missing_executable_is_an_error_naming_the_unit(tmp_path: Path) -> None:
    stack = load(
        tmp_path,
        """
        [units.gpu]
        command = ["no-such-binary-here", "--serve"]
        install_hint = "pip install it"
        """,
    )
    with pytest.raises(ExportError, match=r"unit 'gpu': command 'no-such-binary-here'.*pip"):
        systemd.per_unit_services(stack, dynamod=DYNAMOD)


def test_enable_commands_start_the_entry_point(tmp_path: Path) -> None:
    stack = load(tmp_path)
    per_unit = systemd.per_unit_services(stack, dynamod=DYNAMOD)
    assert systemd.enable_commands(per_unit, stack) == [
        "systemctl daemon-reload",
        "systemctl enable --now dynamod-rollout.target",
    ]
    single = [systemd.stack_service(stack, dynamod=DYNAMOD)]
    assert systemd.enable_commands(single, stack)[-1] == (
        "systemctl enable --now dynamod@rollout.service"
    )


@pytest.mark.parametrize("lease", [None, "30"])
def test_exports_say_how_long_a_dead_worker_stays_routable(
    tmp_path: Path, lease: str | None
) -> None:
    """Nothing revokes a dead worker's lease under supervisord or systemd: the gap names
    the Dynamo lease the stock units set (300 s), or the one --var gives."""
    from dynamod.ops.supervisord import supervisord_gaps

    counter = itertools.count(40000)
    stack = spec.load(
        Path(__file__).resolve().parents[2] / "units/stacks/local.toml",
        state_dir=tmp_path / "state", allocate_port=lambda: next(counter),
        var_overrides={"dynamo_lease_ttl": lease} if lease else None,
    )  # fmt: skip
    want = f"stays routable until its Dynamo lease runs out (ETCD_LEASE_TTL {lease or 300} s;"
    for gaps in (supervisord_gaps(stack), systemd.per_unit_gaps(stack)):
        (rejoin,) = [g for g in gaps if g.startswith("rejoin")]
        assert want in rejoin, rejoin
    no_workers = systemd.per_unit_gaps(load(tmp_path))
    assert not [g for g in no_workers if "Dynamo lease" in g]
