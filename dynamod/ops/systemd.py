"""systemd unit files for a stack. Pure generation: stack in, file texts out.

Two ways to run a stack under systemd:

- `dynamod@.service` (default): systemd supervises dynamod, dynamod supervises the stack.
  Type=notify, so the service is "active" only once every unit passed its readiness probe,
  and the watchdog restarts a wedged dynamod. The instance name picks the state dir:
  `systemctl enable --now dynamod@infra.service` runs in /run/dynamod/infra.
- `--per-unit`: one service per instance (`worker@0` -> `dynamod-worker@0.service`) plus a
  `dynamod-<stack>.target` that wants them all; systemd supervises each process itself. A
  readiness probe becomes an ExecStartPost that waits for it, so `After=` on a dependency
  means "after it is ready", as in dynamod. What systemd cannot do (liveness probes, the
  rejoin protocol) is listed by `per_unit_gaps`.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import TypeAdapter

from dynamod.core import resources
from dynamod.core.spec import Condition, LimitsSpec, LogProbe, Probe, Stack, UnitSpec
from dynamod.ops.supervisord import ENV_NAME, bin_dir, lease_note, resolve_command

STACK_SERVICE = "dynamod@.service"
STATE_ROOT = "/run/dynamod"
# systemd's own default PATH, behind dynamod's bin dir (Environment= cannot extend PATH)
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_STOP_MARGIN = 15.0  # seconds on top of the stop budget: dynamod's own teardown and sweep
_KILL_WAIT = 5.0  # dynamod waits this long after SIGKILL for each unit's group
_START_MARGIN = 60.0  # on top of the longest chain of readiness deadlines
_POST_MARGIN = 10.0  # per unit: on top of its readiness deadline (ExecStartPost)
_UNIT_NAME = re.compile(r"[^A-Za-z0-9:_.-]")
_PROBE: TypeAdapter[Probe] = TypeAdapter(Probe)


@dataclass(frozen=True)
class UnitFile:
    name: str
    text: str


# --------------------------------------------------------------------------- quoting


def quote_arg(arg: str) -> str:
    """One word of an Exec*= command line: C-style escapes inside double quotes, '%'
    doubled (specifiers) and '$' doubled (environment variable expansion)."""
    if arg == ";":
        return "\\;"
    if arg and re.fullmatch(r"[A-Za-z0-9_@+=:,./-]+", arg):
        return arg
    return '"' + _escape(arg).replace("$", "$$") + '"'


def _escape(text: str) -> str:
    out = []
    for char in text:
        if char in {"\\", '"'}:
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return "".join(out).replace("%", "%%")


def command_line(argv: Sequence[str]) -> str:
    return " ".join(quote_arg(arg) for arg in argv)


def environment_line(key: str, value: str) -> str:
    """`Environment="KEY=value"`: quoted and escaped like a command word, '%' doubled;
    '$' is literal in Environment= (no variable expansion there)."""
    if not ENV_NAME.match(key):
        raise ValueError(f"{key!r} is not a valid environment variable name")
    return f'Environment="{_escape(f"{key}={value}")}"'


def _text(value: str) -> str:
    """A free-text setting (Description=): one line, specifiers escaped."""
    return " ".join(value.split()).replace("%", "%%")


def _seconds(value: float) -> str:
    return str(math.ceil(value))


# --------------------------------------------------------------------------- budgets


def stop_budget(stack: Stack) -> float:
    """Seconds dynamod may need to stop the stack: every unit's stop timeout in sequence
    (dynamod stops independent units in parallel, so this is an upper bound), the wait
    after SIGKILL for each, and a margin for the final sweep."""
    units = stack.units.values()
    return sum(u.stop.timeout + _KILL_WAIT for u in units) + _STOP_MARGIN


def start_budget(stack: Stack) -> float:
    """Seconds bring-up may take: the longest dependency chain of readiness deadlines
    (units on different chains start in parallel), plus a margin for restarts."""
    longest: dict[str, float] = {}
    for name in stack.order:
        spec = stack.units[name]
        before = max((longest[dep] for dep in spec.depends_on), default=0.0)
        longest[name] = before + (spec.ready.deadline if spec.ready else 0.0)
    return max(longest.values(), default=0.0) + _START_MARGIN


# --------------------------------------------------------------------------- dynamod@


def dynamod_command() -> list[str]:
    """How to run this dynamod by absolute path (the venv's script, else `python -m`)."""
    script = bin_dir() / "dynamod"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "dynamod"]


def stack_service(
    stack: Stack,
    *,
    dynamod: Sequence[str],
    variables: Iterable[str] = (),
    watchdog_sec: int = 30,
) -> UnitFile:
    """`dynamod@.service`: dynamod runs the stack in the foreground, state in /run/dynamod/%i."""
    state = f"{STATE_ROOT}/%i"
    base = [*(quote_arg(a) for a in dynamod), "--state-dir", state]
    var_args = [w for v in variables for w in ("--var", quote_arg(v))]
    up = " ".join([*base, "up", quote_arg(str(stack.path)), *var_args])
    text = f"""\
# Generated by `dynamod systemd generate` from {_text(str(stack.path))}.
# systemd supervises dynamod; dynamod supervises the stack ({len(stack.units)} units).
# The instance name picks the state dir: `systemctl enable --now {stack_instance(stack)}`
# keeps its socket, logs and data in {STATE_ROOT}/{_unit_name_part(stack.name)}.
[Unit]
Description=dynamod stack {_text(stack.name)} (%i)
After=network.target

[Service]
# READY=1 comes once every unit passed its readiness probe, not when dynamod starts.
Type=notify
NotifyAccess=main
# WATCHDOG=1 comes every WatchdogSec/2 from dynamod's event loop; a wedged dynamod is
# killed and restarted.
WatchdogSec={watchdog_sec}
ExecStart={up}
ExecStop={" ".join([*base, "down"])}
# mixed: the stop signal goes to dynamod alone, which stops its units in reverse
# dependency order (dependents first, each unit's stop signal and timeout) and sweeps
# what they left; only after TimeoutStopSec does SIGKILL reach the whole cgroup.
# control-group would signal every process at once and defeat that order.
KillMode=mixed
# dynamod runs each unit in a cgroup of its own below the service's (cgroup v2) and
# empties it with cgroup.kill; Delegate=yes hands it that subtree.
Delegate=yes
# bring-up: longest chain of readiness deadlines + {_START_MARGIN:g}s
TimeoutStartSec={_seconds(start_budget(stack))}
# teardown: sum of the units' stop timeouts + {_KILL_WAIT:g}s each after SIGKILL
# + {_STOP_MARGIN:g}s margin
TimeoutStopSec={_seconds(stop_budget(stack))}
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""
    return UnitFile(STACK_SERVICE, text)


# --------------------------------------------------------------------------- per unit


def service_name(instance: str) -> str:
    """`worker@0` -> `dynamod-worker@0.service`."""
    return f"dynamod-{instance}.service"


def target_name(stack: Stack) -> str:
    return f"dynamod-{_unit_name_part(stack.name)}.target"


def stack_instance(stack: Stack) -> str:
    """The suggested instance of dynamod@.service for this stack."""
    return f"dynamod@{_unit_name_part(stack.name)}.service"


def _unit_name_part(text: str) -> str:
    return _UNIT_NAME.sub("-", text)


def readiness_gate(probe: Probe | None) -> bool:
    """A probe ExecStartPost can wait for (log probes need dynamod reading the output)."""
    return probe is not None and not isinstance(probe, LogProbe)


def per_unit_services(stack: Stack, *, dynamod: Sequence[str]) -> list[UnitFile]:
    """One service per instance plus the stack's target, in start order."""
    # a unit outside the stack (`outside = HOST:PORT`) gets no service: it is not ours
    own = [name for name in stack.order if stack.units[name].outside is None]
    files = [_unit_service(stack, stack.units[name], dynamod) for name in own]
    wants = " ".join(service_name(name) for name in own)
    target = f"""\
# Generated by `dynamod systemd generate --per-unit` from {_text(str(stack.path))}.
# `systemctl enable --now {target_name(stack)}` starts every unit of the stack.
[Unit]
Description=dynamod stack {_text(stack.name)} (one service per unit)
Wants={wants}

[Install]
WantedBy=multi-user.target
"""
    return [*files, UnitFile(target_name(stack), target)]


def _unit_service(stack: Stack, spec: UnitSpec, dynamod: Sequence[str]) -> UnitFile:
    oneshot = spec.type == "oneshot"
    deps = " ".join(
        service_name(dep) for dep in spec.depends_on if stack.units[dep].outside is None
    )
    unit = [
        f"Description={_text(spec.description or spec.name)} (dynamod stack {_text(stack.name)})",
        f"PartOf={target_name(stack)}",
    ]
    if deps:
        unit += [f"Requires={deps}", f"After={deps}"]
    unit += [
        f"StartLimitIntervalSec={_seconds(spec.restart.limit_interval)}",
        f"StartLimitBurst={spec.restart.limit_burst}",
    ]
    # exec: "started" once the binary runs (not at fork), so a missing binary fails the start
    service = ["Type=oneshot", "RemainAfterExit=yes"] if oneshot else ["Type=exec"]
    service.append(f"ExecStart={command_line(resolve_command(spec))}")
    start_timeout = 0.0
    if readiness_gate(spec.ready) and not oneshot:
        assert spec.ready is not None
        probe = _PROBE.dump_json(spec.ready).decode()
        wait = [*dynamod, "systemd", "wait-ready", probe]
        service += [
            "# readiness: the unit counts as started (After= is satisfied) once this passes",
            f"ExecStartPost={command_line(wait)}",
        ]
        start_timeout = spec.ready.deadline + _POST_MARGIN
    path = spec.env.get("PATH", f"{bin_dir()}:{_SYSTEM_PATH}")
    service += [environment_line(k, v) for k, v in {"PATH": path, **spec.env}.items()]
    if spec.cwd:
        service.append(f"WorkingDirectory={spec.cwd.replace('%', '%%')}")
    restart = {"never": "no", "on-failure": "on-failure", "always": "always"}[spec.restart.policy]
    if oneshot and restart == "always":
        restart = "on-failure"  # systemd refuses Restart=always for oneshot services
    service += [
        "KillMode=control-group",
        f"KillSignal={spec.stop.signal}",
        f"TimeoutStopSec={_seconds(spec.stop.timeout)}",
    ]
    if start_timeout:
        service.append(f"TimeoutStartSec={_seconds(start_timeout)}")
    service += [f"Restart={restart}", f"RestartSec={spec.restart.backoff_initial:g}"]
    service += resource_control(spec.limits)
    text = "\n".join(
        [
            f"# Generated by `dynamod systemd generate --per-unit` from {_text(spec.source)}",
            f"# (stack {_text(stack.name)}, instance {spec.name}). Ports are fixed: regenerate,",
            "# do not edit.",
            "[Unit]",
            *unit,
            "",
            "[Service]",
            *service,
            "",
        ]
    )
    return UnitFile(service_name(spec.name), text)


def resource_control(limits: LimitsSpec | None) -> list[str]:
    """A unit's `limits` as systemd's resource-control settings (their names are where
    the table's come from); systemd picks the cgroup controllers itself. A `nice` without
    a `cpu_weight` is a CPUWeight too, as dynamod's own v2 cgroups get it: each service is
    a cgroup of its own, weighed as one against the others whatever its processes' nice."""
    if limits is None:
        return []
    weight = limits.cpu_weight
    if weight is None and limits.nice is not None:
        weight = resources.nice_weight(limits.nice)
    pairs = [
        ("MemoryMax", limits.memory_max),
        ("MemoryHigh", limits.memory_high),
        ("CPUWeight", weight),
        # "%" starts a specifier in a unit file: "%%" is the percent sign
        ("CPUQuota", f"{limits.cpu_quota:g}%%" if limits.cpu_quota is not None else None),
        ("AllowedCPUs", limits.cpuset),
        ("TasksMax", limits.pids_max),
        ("Nice", limits.nice),
    ]
    return [f"{name}={value}" for name, value in pairs if value is not None]


def per_unit_gaps(stack: Stack) -> list[str]:
    """What the per-unit services do not do that dynamod does."""
    units = list(stack.units.values())
    live = [u.name for u in units if u.live is not None]
    logged = [u.name for u in units if isinstance(u.ready, LogProbe)]
    workers = [u.name for u in units if "dynamo" in u.tables]
    completes = [
        f"{u.name} -> {dep}"
        for u in units
        for dep, cond in u.depends_on.items()
        if cond is Condition.COMPLETED and stack.units[dep].type != "oneshot"
    ]
    gaps = [
        "restart backoff: RestartSec is a fixed delay, not exponential backoff with jitter",
    ]
    if live:
        gaps.append(f"liveness probes are not run (a hung {', '.join(live)} is not restarted)")
    if logged:
        gaps.append(f"log-line readiness probes cannot be waited for ({', '.join(logged)})")
    if workers:
        gaps.append(
            "rejoin / lease revocation: a restarted shard takes traffic without policy replay "
            f"and a dead worker's etcd lease is not revoked ({', '.join(workers)})"
            + lease_note([u for u in units if "dynamo" in u.tables])
        )
    if completes:
        gaps.append(
            "'completed' on a long-running service means only 'started' here: "
            + ", ".join(completes)
        )
    return gaps


def enable_commands(files: Sequence[UnitFile], stack: Stack) -> list[str]:
    """What to run after installing: reload, then enable and start the entry point."""
    names = {f.name for f in files}
    entry = target_name(stack) if target_name(stack) in names else stack_instance(stack)
    return ["systemctl daemon-reload", f"systemctl enable --now {entry}"]
