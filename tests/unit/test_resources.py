"""A unit's `limits` table: parsing and validation (the stack file), and how each limit
is enforced on a host (core/resources.py's plan, core/enforce.py's reading of the v1
hierarchies) as pure logic. The real cgroups are tests/integration/test_limits.py's."""

from __future__ import annotations

import itertools
import os
import resource
from pathlib import Path

import pytest

from dynamod.core import enforce, resources, spec
from dynamod.core.cgroups import remove_v1_run, v1_hierarchies
from dynamod.core.errors import SpecErrors
from dynamod.core.resources import Mechanism, Offer
from dynamod.core.spec.models import LimitsSpec
from dynamod.core.spec.quantities import cpu_list_text, parse_cpu_list, parse_size, size_text

FIRST_CPU = min(os.sched_getaffinity(0))
ALL = frozenset(resources.CONTROLLERS)


def load(tmp_path: Path, limits: str, replicas: int = 1) -> spec.Stack:
    path = tmp_path / "stack.toml"
    many = f"replicas = {replicas}\n" if replicas > 1 else ""
    path.write_text(f'[units.app]\ncommand = ["app"]\n{many}limits = {limits}\n')
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter))


def error_of(tmp_path: Path, limits: str) -> str:
    with pytest.raises(SpecErrors) as info:
        load(tmp_path, limits)
    assert len(info.value.errors) == 1
    return str(info.value.errors[0])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2G", 2 << 30), ("1.5G", 3 << 29), ("512M", 512 << 20), ("64k", 64 << 10),
     ("1GiB", 1 << 30), ("100MB", 100 << 20), (4096, 4096)],
)
def test_sizes_read_as_systemd_reads_them(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2X", "", "G", "-1M", True, 1.5, None])
def test_a_size_that_is_not_one_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(bad)


def test_sizes_and_cpu_lists_are_written_back_as_a_stack_file_writes_them() -> None:
    assert [size_text(v) for v in (64 << 20, 3 << 29, 2 << 30, 1000)] == [
        "64M", "1536M", "2G", "1000"]  # fmt: skip
    assert parse_cpu_list("0-2,4, 6") == {0, 1, 2, 4, 6}
    assert cpu_list_text({0, 1, 2, 4, 6, 7}) == "0-2,4,6-7"
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list("0-")
    with pytest.raises(ValueError, match="empty"):
        parse_cpu_list("3-1")


def test_a_full_limits_table_is_read_into_the_unit_spec(tmp_path: Path) -> None:
    stack = load(tmp_path, f"""{{ memory_max = "2G", memory_high = "1.5G", cpu_weight = 100,
        cpu_quota = "150%", cpuset = "{FIRST_CPU}", pids_max = 512,
        nice = 10 }}""".replace("\n", ""))
    limits = stack.units["app"].limits
    assert limits is not None
    assert limits.words() == {
        "memory_max": "2G", "memory_high": "1536M", "cpu_weight": "100",
        "cpu_quota": "150%", "cpuset": str(FIRST_CPU), "pids_max": "512", "nice": "10",
    }  # fmt: skip


def test_a_unit_without_limits_has_none(tmp_path: Path) -> None:
    assert load(tmp_path, "{}").units["app"].limits == LimitsSpec()
    path = tmp_path / "plain.toml"
    path.write_text('[units.app]\ncommand = ["app"]\n')
    stack = spec.load(path, state_dir=tmp_path / "s", allocate_port=lambda: 40000)
    assert stack.units["app"].limits is None


@pytest.mark.parametrize(
    ("limits", "field", "words"),
    [
        ('{ memory_max = "2X" }', "limits.memory_max", 'expected a size such as "512M"'),
        ('{ memory_max = "10K" }', "limits.memory_max", "greater than or equal to 1048576"),
        ('{ cpu_quota = 150 }', "limits.cpu_quota", 'percentage of one CPU such as "150%"'),
        ('{ cpu_quota = "0.5%" }', "limits.cpu_quota", "greater than or equal to 1"),
        ('{ cpu_weight = 0 }', "limits.cpu_weight", "greater than or equal to 1"),
        ('{ cpuset = "0-" }', "limits.cpuset", "expected a CPU list"),
        ('{ cpuset = "4000" }', "limits.cpuset", "not among this host's usable CPUs"),
        ('{ pids_max = 0 }', "limits.pids_max", "greater than or equal to 1"),
        ('{ nice = 20 }', "limits.nice", "less than or equal to 19"),
        ('{ nice = "low" }', "limits.nice", "valid integer"),
        ('{ memroy_max = "1G" }', "limits.memroy_max", "unknown key"),
        ('{ memory_max = "1G", memory_high = "2G" }', "limits.memory_high", "2G is above"),
    ],
)
def test_a_bad_limit_is_one_line_naming_file_unit_and_field(
    tmp_path: Path, limits: str, field: str, words: str
) -> None:
    message = error_of(tmp_path, limits)
    assert "\n" not in message
    assert str(tmp_path / "stack.toml") in message and "app" in message
    assert f"field '{field}'" in message
    assert words in message


def test_limits_render_per_replica(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    stack = load(tmp_path, '{ cpuset = "{index}" }', replicas=2)
    assert [stack.units[f"app@{i}"].limits.cpuset for i in (0, 1)] == ["0", "1"]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- the plan

LIMITS = LimitsSpec.model_validate(
    {"memory_max": "64M", "memory_high": "48M", "cpu_weight": 50, "cpu_quota": "150%",
     "cpuset": str(FIRST_CPU), "pids_max": 16}
)


def test_with_v2_controllers_every_limit_is_a_v2_file() -> None:
    plan = resources.plan(LIMITS, Offer(v2=ALL))
    assert dict(plan.v2_files) == {
        "memory.max": str(64 << 20), "memory.high": str(48 << 20), "cpu.weight": "50",
        "cpu.max": "150000 100000", "cpuset.cpus": str(FIRST_CPU), "pids.max": "16",
    }  # fmt: skip
    assert not plan.v1_files and not plan.rlimits and plan.cpus is None
    assert plan.mechanism() == "cgroup v2"
    assert plan.status(0)["limits"]["memory_max"] == "64M via cgroup v2 memory.max"


def test_on_a_hybrid_host_the_v1_hierarchies_carry_them() -> None:
    plan = resources.plan(LIMITS, Offer(v1=ALL))
    assert {c: dict(f) for c, f in plan.v1_files.items()} == {
        "memory": {"memory.limit_in_bytes": str(64 << 20),
                   "memory.soft_limit_in_bytes": str(48 << 20)},
        "cpu": {"cpu.shares": "512", "cpu.cfs_period_us": "100000",
                "cpu.cfs_quota_us": "150000"},
        "cpuset": {"cpuset.cpus": str(FIRST_CPU)},
        "pids": {"pids.max": "16"},
    }  # fmt: skip
    # the period is written before the quota (a quota above the old period's is refused)
    assert list(plan.v1_files["cpu"])[1:] == ["cpu.cfs_period_us", "cpu.cfs_quota_us"]
    assert not plan.v2_files and plan.mechanism() == "cgroup v1"
    assert plan.memory_max_words() == "memory_max 64M"


def test_each_controller_goes_where_it_is_offered() -> None:
    plan = resources.plan(LIMITS, Offer(v2=frozenset({"memory"}), v1=frozenset({"pids"})))
    kinds = {name: e.mechanism for name, e in plan.enforced.items()}
    assert kinds == {
        "memory_max": Mechanism.CGROUP_V2, "memory_high": Mechanism.CGROUP_V2,
        "cpu_weight": Mechanism.NONE, "cpu_quota": Mechanism.NONE,
        "cpuset": Mechanism.AFFINITY, "pids_max": Mechanism.CGROUP_V1,
    }  # fmt: skip
    assert plan.mechanism() == "cgroup v2 + cgroup v1 + affinity + not enforced"


def test_nice_is_set_per_process_on_every_host() -> None:
    limits = LimitsSpec.model_validate({"nice": 10, "memory_max": "64M"})
    for offer in (Offer(), Offer(v2=frozenset({"memory"}))):  # no cgroups, and v2
        plan = resources.plan(limits, offer)
        assert plan.nice == 10 and plan.enforced["nice"].mechanism is Mechanism.PRIORITY
        assert plan.status(0)["limits"]["nice"] == "10 via priority setpriority"
        assert not plan.autogroup and "cpu.weight" not in plan.v2_files
    assert resources.plan(LimitsSpec.model_validate({"pids_max": 8}), Offer()).nice is None


def test_nice_weighs_the_units_session_or_its_cpu_cgroup_where_the_kernel_weighs_those() -> None:
    """A unit is a session of its own: with autogroups the kernel weighs sessions, so the
    session takes the nice; in a v2 cgroup with the cpu controller the cgroup is weighed,
    so it takes the nice's weight, unless cpu_weight says otherwise."""
    nice = LimitsSpec.model_validate({"nice": 10})
    plan = resources.plan(nice, Offer(autogroup=True))
    assert plan.autogroup and plan.nice == 10
    shown = plan.status(0)["limits"]["nice"]
    assert shown == "10 via priority setpriority + the session's autogroup"
    plan = resources.plan(nice, Offer(v2=frozenset({"cpu"}), autogroup=True))
    assert plan.v2_files == {"cpu.weight": "11"} and not plan.autogroup
    assert plan.status(0)["limits"]["nice"] == "10 via priority setpriority + cpu.weight 11"
    weighed = LimitsSpec.model_validate({"nice": 10, "cpu_weight": 300})
    plan = resources.plan(weighed, Offer(v2=frozenset({"cpu"})))
    assert plan.v2_files == {"cpu.weight": "300"} and plan.nice == 10


def test_a_nices_weight_is_the_kernels() -> None:
    assert [resources.nice_weight(n) for n in (-20, -1, 0, 1, 10, 19)] == [
        8668, 125, 100, 80, 11, 1,
    ]
    weights = [resources.nice_weight(n) for n in range(-20, 20)]
    assert weights == sorted(weights, reverse=True)


def test_without_cgroups_rlimits_and_the_affinity_are_the_fallback_and_say_so() -> None:
    plan = resources.plan(LIMITS, Offer(missing={"cpu": "no cpu controller (v1: not mounted)"}))
    assert set(plan.rlimits) == {(resource.RLIMIT_AS, 64 << 20), (resource.RLIMIT_NPROC, 16)}
    assert plan.cpus == {FIRST_CPU}
    shown = plan.status(0)["limits"]
    assert shown["memory_max"].startswith("64M via rlimit RLIMIT_AS")
    assert shown["pids_max"].startswith("16 via rlimit RLIMIT_NPROC")
    assert shown["cpu_quota"] == "150% NOT enforced (no cpu controller (v1: not mounted))"
    assert shown["memory_high"] == "48M NOT enforced (no memory controller)"


def test_a_tiny_quota_is_the_kernels_minimum_and_weights_map_to_shares() -> None:
    tiny = LimitsSpec.model_validate({"cpu_quota": "1%", "cpu_weight": 10000})
    assert resources.v1_settings(tiny)["cpu_quota"]["cpu.cfs_quota_us"] == "1000"
    assert resources.v1_settings(tiny)["cpu_weight"]["cpu.shares"] == "102400"
    assert resources.v1_settings(LimitsSpec(cpu_weight=1))["cpu_weight"]["cpu.shares"] == "10"


def test_oom_kill_counts_are_read_from_v1_and_v2_files() -> None:
    assert resources.oom_kill_count("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert resources.oom_kill_count("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n") == 1
    assert resources.oom_kill_count("oom_kill_disable 0\nunder_oom 0\n") is None  # < 4.13


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 /outer /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PROC_CGROUP = """\
8:pids:/outer/job
4:memory:/process_api/abc
3:cpuset:/
1:cpu,cpuacct:/svc
0::/
"""


def test_the_v1_hierarchies_are_found_with_our_own_cgroup_in_each() -> None:
    assert v1_hierarchies(PROC_CGROUP, MOUNTINFO) == {
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct/svc"),
        "cpuset": Path("/sys/fs/cgroup/cpuset"),
        "memory": Path("/sys/fs/cgroup/memory/process_api/abc"),
        "pids": Path("/sys/fs/cgroup/pids/job"),
    }
    assert v1_hierarchies("0::/\n", MOUNTINFO) == {}  # pure v2: none


def test_a_dead_runs_v1_cgroups_are_removed_and_only_its_own(tmp_path: Path) -> None:
    memory, pids = tmp_path / "memory" / "job", tmp_path / "pids"
    for base in (memory, pids):
        (base / "dynamod-r1" / "hog").mkdir(parents=True)
    (memory / "dynamod-r2").mkdir()  # another run's
    assert remove_v1_run("r1", {"memory": memory, "pids": pids, "cpu": tmp_path / "cpu"}) == []
    assert sorted(p.name for p in memory.iterdir()) == ["dynamod-r2"]
    assert list(pids.iterdir()) == []


def test_the_supervisord_export_says_it_drops_the_limits(tmp_path: Path) -> None:
    from dynamod.ops.supervisord import supervisord_gaps

    limited = supervisord_gaps(load(tmp_path, '{ pids_max = 64 }'))
    assert any(g.startswith("limits: supervisord sets no") and "(app have" in g for g in limited)
    assert not any(g.startswith("limits:") for g in supervisord_gaps(load(tmp_path, "{}")))


def test_autogroups_are_read_from_the_kernels_switch(tmp_path: Path) -> None:
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("0\n")
    assert not enforce._autogroups(switch)
    switch.write_text("1\n")
    assert enforce._autogroups(switch) == Path("/proc/self/autogroup").exists()
    assert not enforce._autogroups(tmp_path / "absent")
