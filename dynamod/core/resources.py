"""How a unit's `limits` are enforced on this host, decided per limit: the cgroup v2
controller where the stack's cgroup has it, else the controller's v1 hierarchy (hybrid
and older hosts), else what a process can be given without cgroups (RLIMIT_AS for
memory_max, RLIMIT_NPROC for pids_max, the CPU affinity for cpuset); a limit none of them
can carry is reported as not enforced. Pure logic: the files and values to write, the
rlimits to set, and how an OOM kill is read from the counters. The I/O is
`core/enforce.py`'s.

    limit        cgroup v2              cgroup v1                        without cgroups
    memory_max   memory.max             memory.limit_in_bytes            RLIMIT_AS
    memory_high  memory.high            memory.soft_limit_in_bytes       -
    cpu_weight   cpu.weight             cpu.shares (weight * 1024/100)   -
    cpu_quota    cpu.max                cpu.cfs_quota_us / cfs_period_us -
    cpuset       cpuset.cpus            cpuset.cpus (+ cpuset.mems)      sched_setaffinity
    pids_max     pids.max               pids.max                         RLIMIT_NPROC
    nice         cpu.weight (its nice's) -                               setpriority
                                        (+ the session's autogroup nice)

`nice` is set per process between fork and exec (setpriority) on every host, but that
alone orders only processes that the scheduler weighs against each other. A unit starts in
a session of its own, and where the kernel groups sessions (`sched_autogroup_enabled`),
each session is weighed as one against every other whatever its processes' nice: so the
session's autogroup gets the nice too (/proc/self/autogroup). Where the unit has a v2
cgroup with the cpu controller, that cgroup is the group weighed: it gets the weight the
kernel gives that nice (10 -> cpu.weight 11), unless the unit sets `cpu_weight` itself.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from dynamod.core import cgroups
from dynamod.core.spec import quantities
from dynamod.core.spec.models import LimitsSpec
from dynamod.core.status import LimitsStatus

CONTROLLERS = cgroups.CONTROLLERS
CONTROLLER_OF = {
    "memory_max": "memory",
    "memory_high": "memory",
    "cpu_weight": "cpu",
    "cpu_quota": "cpu",
    "cpuset": "cpuset",
    "pids_max": "pids",
}
CFS_PERIOD_US = 100_000


class Mechanism(StrEnum):
    CGROUP_V2 = "cgroup v2"
    CGROUP_V1 = "cgroup v1"
    RLIMIT = "rlimit"
    AFFINITY = "affinity"
    PRIORITY = "priority"
    NONE = "not enforced"


@dataclass(frozen=True)
class Offer:
    """What this host offers a run: the v2 controllers its units' cgroups have, and the v1
    hierarchies it may create cgroups in; for each controller it lacks, why."""

    v2: frozenset[str] = frozenset()
    v1: frozenset[str] = frozenset()
    missing: Mapping[str, str] = field(default_factory=dict)  # controller -> why
    autogroup: bool = False  # the kernel weighs each session as one (sched_autogroup_enabled)


@dataclass(frozen=True)
class Enforcement:
    """One limit: what it is set to and how it is enforced ("memory.limit_in_bytes")."""

    value: str  # as a stack file writes it: "64M"
    mechanism: Mechanism
    how: str


@dataclass(frozen=True)
class Confinement:
    """What a unit's process gets between fork and exec: the cgroups it joins (each
    `cgroup.procs`), its rlimits, its CPU affinity, its scheduling priority."""

    procs_files: tuple[Path, ...] = ()
    rlimits: tuple[tuple[int, int], ...] = ()
    cpus: frozenset[int] | None = None
    nice: int | None = None
    autogroup: bool = False  # the nice goes to the session's autogroup too


@dataclass(frozen=True)
class Plan:
    """How one unit's limits are enforced, and what that takes."""

    limits: LimitsSpec
    enforced: Mapping[str, Enforcement]
    v2_files: Mapping[str, str]  # file in the unit's v2 cgroup -> value
    v1_files: Mapping[str, Mapping[str, str]]  # controller -> file -> value, in write order
    rlimits: tuple[tuple[int, int], ...] = ()
    cpus: frozenset[int] | None = None  # sched_setaffinity, without a cpuset controller
    nice: int | None = None  # setpriority
    autogroup: bool = False  # and the session's autogroup nice

    def mechanism(self) -> str:
        used = [m for m in Mechanism if any(e.mechanism is m for e in self.enforced.values())]
        return " + ".join(used)

    def memory_max_words(self) -> str | None:
        """"memory_max 64M" when memory_max is set: what an OOM kill message names."""
        value = self.limits.memory_max
        return f"memory_max {quantities.size_text(value)}" if value is not None else None

    def status(self, oom_kills: int) -> LimitsStatus:
        return {
            "mechanism": self.mechanism(),
            "limits": {
                name: f"{e.value} via {e.mechanism} {e.how}".rstrip()
                if e.mechanism is not Mechanism.NONE
                else f"{e.value} NOT enforced ({e.how})"
                for name, e in self.enforced.items()
            },
            "oom_kills": oom_kills,
        }


def v2_settings(limits: LimitsSpec) -> dict[str, dict[str, str]]:
    """limit -> {v2 file: value}."""
    out: dict[str, dict[str, str]] = {}
    if limits.memory_max is not None:
        out["memory_max"] = {"memory.max": str(limits.memory_max)}
    if limits.memory_high is not None:
        out["memory_high"] = {"memory.high": str(limits.memory_high)}
    if limits.cpu_weight is not None:
        out["cpu_weight"] = {"cpu.weight": str(limits.cpu_weight)}
    if limits.cpu_quota is not None:
        out["cpu_quota"] = {"cpu.max": f"{_quota_us(limits.cpu_quota)} {CFS_PERIOD_US}"}
    if limits.cpuset is not None:
        out["cpuset"] = {"cpuset.cpus": limits.cpuset}
    if limits.pids_max is not None:
        out["pids_max"] = {"pids.max": str(limits.pids_max)}
    return out


def v1_settings(limits: LimitsSpec) -> dict[str, dict[str, str]]:
    """limit -> {v1 file: value}, in the order they must be written. A v1 cpuset cgroup
    starts with no memory nodes: the enforcer copies `cpuset.mems` from its parent."""
    out: dict[str, dict[str, str]] = {}
    if limits.memory_max is not None:
        out["memory_max"] = {"memory.limit_in_bytes": str(limits.memory_max)}
    if limits.memory_high is not None:
        out["memory_high"] = {"memory.soft_limit_in_bytes": str(limits.memory_high)}
    if limits.cpu_weight is not None:  # v1's default share 1024 is v2's weight 100
        out["cpu_weight"] = {"cpu.shares": str(max(2, limits.cpu_weight * 1024 // 100))}
    if limits.cpu_quota is not None:
        out["cpu_quota"] = {
            "cpu.cfs_period_us": str(CFS_PERIOD_US),
            "cpu.cfs_quota_us": str(_quota_us(limits.cpu_quota)),
        }
    if limits.cpuset is not None:
        out["cpuset"] = {"cpuset.cpus": limits.cpuset}
    if limits.pids_max is not None:
        out["pids_max"] = {"pids.max": str(limits.pids_max)}
    return out


def _quota_us(percent: float) -> int:
    return max(1000, round(percent / 100 * CFS_PERIOD_US))  # the kernel's minimum is 1 ms


_WITHOUT_CGROUPS: dict[str, tuple[Mechanism, str]] = {
    "memory_max": (Mechanism.RLIMIT, "RLIMIT_AS (address space, not resident memory)"),
    "pids_max": (Mechanism.RLIMIT, "RLIMIT_NPROC (counts every process of the user)"),
    "cpuset": (Mechanism.AFFINITY, "sched_setaffinity (the unit may widen it itself)"),
}


def plan(limits: LimitsSpec, offer: Offer) -> Plan:
    """Per limit, the first of v2, v1, rlimit/affinity that this host offers."""
    enforced: dict[str, Enforcement] = {}
    v2_files: dict[str, str] = {}
    v1_files: dict[str, dict[str, str]] = {}
    rlimits: list[tuple[int, int]] = []
    cpus: frozenset[int] | None = None
    words = limits.words()
    v2, v1 = v2_settings(limits), v1_settings(limits)
    for name, value in words.items():
        if name == "nice":
            continue
        controller = CONTROLLER_OF[name]
        if controller in offer.v2:
            v2_files.update(v2[name])
            enforced[name] = Enforcement(value, Mechanism.CGROUP_V2, " ".join(v2[name]))
        elif controller in offer.v1:
            v1_files.setdefault(controller, {}).update(v1[name])
            enforced[name] = Enforcement(value, Mechanism.CGROUP_V1, " ".join(v1[name]))
        elif name in _WITHOUT_CGROUPS:
            mechanism, how = _WITHOUT_CGROUPS[name]
            enforced[name] = Enforcement(value, mechanism, how)
            if name == "memory_max" and limits.memory_max is not None:
                rlimits.append((resource.RLIMIT_AS, limits.memory_max))
            elif name == "pids_max" and limits.pids_max is not None:
                rlimits.append((resource.RLIMIT_NPROC, limits.pids_max))
            elif name == "cpuset" and limits.cpuset is not None:
                cpus = quantities.parse_cpu_list(limits.cpuset)
        else:
            why = offer.missing.get(controller, f"no {controller} controller")
            enforced[name] = Enforcement(value, Mechanism.NONE, why)
    autogroup = False
    if limits.nice is not None:
        how = "setpriority"
        if "cpu" in offer.v2 and limits.cpu_weight is None:
            weight = nice_weight(limits.nice)
            v2_files["cpu.weight"] = str(weight)
            how += f" + cpu.weight {weight}"
        elif offer.autogroup:
            autogroup = True
            how += " + the session's autogroup"
        enforced["nice"] = Enforcement(str(limits.nice), Mechanism.PRIORITY, how)
    return Plan(
        limits, enforced, v2_files, v1_files, tuple(rlimits), cpus, limits.nice, autogroup
    )


# the kernel's weight per nice -20 .. 19 (kernel/sched/core.c, sched_prio_to_weight)
_PRIO_TO_WEIGHT = (
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
)  # fmt: skip


def nice_weight(nice: int) -> int:
    """The cgroup v2 cpu.weight that weighs a group as the kernel weighs a task at `nice`
    (nice 0 -> 100, the default; 10 -> 11; 19 -> 1)."""
    return max(1, min(10000, round(_PRIO_TO_WEIGHT[nice + 20] * 100 / 1024)))


def oom_kill_count(text: str) -> int | None:
    """The `oom_kill N` line of v2's memory.events or v1's memory.oom_control (kernels
    since 4.13); None where the file has none."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
