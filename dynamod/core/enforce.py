"""Enforcing units' `limits` on this host (the plan is core/resources.py's): finds what
the host offers at the first unit with limits (the v2 controllers the stack's cgroup can
hand its units, the v1 hierarchies this process may create cgroups in), creates the
unit's cgroups and writes its limits before each spawn, reads its OOM kills after an
exit, and removes every cgroup it created once their processes are gone: `down` leaves
nothing in any hierarchy. A v1 cgroup of a run is `<hierarchy>/<our cgroup>/dynamod-RUN/UNIT`,
as the v2 one is `<our cgroup>/dynamod-RUN/UNIT`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from dynamod.core import cgroups, resources
from dynamod.core.resources import Confinement, Mechanism, Offer, Plan
from dynamod.core.spec.models import LimitsSpec

log = structlog.get_logger("dynamod.enforce")


class Enforcer:
    """The run's limits: one per daemon run, used by the ProcessHost."""

    def __init__(
        self,
        run_id: str,
        containment: cgroups.Containment,
        *,
        hierarchies: Mapping[str, Path] | None = None,
    ) -> None:
        self.run_id = run_id
        self.containment = containment
        self._hierarchies = hierarchies  # None: read from /proc at first use
        self._offer: Offer | None = None
        self._v1_run: dict[str, Path] = {}  # controller -> this run's dir in its hierarchy
        self.plans: dict[str, Plan] = {}  # unit -> its limits as now enforced
        self._v1_unit: dict[str, dict[str, Path]] = {}  # unit -> controller -> its dir
        self._oom_seen: dict[str, int] = {}  # unit -> OOM kill count at its spawn

    def offer(self) -> Offer:
        if self._offer is None:
            self._offer = self._detect()
            log.info("limits.offer", v2=sorted(self._offer.v2), v1=sorted(self._offer.v1),
                     missing=dict(self._offer.missing),
                     autogroup=self._offer.autogroup)  # fmt: skip
        return self._offer

    def _detect(self) -> Offer:
        v2: set[str] = set()
        missing: dict[str, str] = {}
        root = self.containment.root
        if root is not None:
            try:
                offered = set((root / "cgroup.controllers").read_text().split())
            except OSError:
                offered = set()
            for controller in sorted(offered & set(resources.CONTROLLERS)):
                try:
                    (root / "cgroup.subtree_control").write_text(f"+{controller}")
                    v2.add(controller)
                except OSError as exc:
                    missing[controller] = f"cannot enable {controller} in {root}: {exc.strerror}"
        hierarchies = self._hierarchies
        if hierarchies is None:
            hierarchies = cgroups.v1_hierarchies()
        v1: set[str] = set()
        for controller in resources.CONTROLLERS:
            if controller in v2:
                continue
            base = hierarchies.get(controller)
            if base is not None and os.access(base, os.W_OK):
                v1.add(controller)
                missing.pop(controller, None)
            elif controller not in missing:
                missing[controller] = (
                    f"no {controller} controller (cgroup v2: none enabled here; v1: "
                    + (f"{base} not writable)" if base is not None else "not mounted)")
                )
        self._hierarchies = hierarchies
        return Offer(frozenset(v2), frozenset(v1), missing, autogroup=_autogroups())

    def prepare(self, unit: str, limits: LimitsSpec | None) -> Confinement:
        """Before a spawn: the unit's cgroups made and its limits written. Raises
        CgroupError naming the file when the host refuses a value."""
        self.release(unit)
        if limits is None:
            self.plans.pop(unit, None)
            return Confinement()
        plan = resources.plan(limits, self.offer())
        self.plans[unit] = plan
        procs: list[Path] = []
        if plan.v2_files:
            where = self.containment.unit(unit)
            assert where is not None  # v2 is offered only with a stack cgroup
            cgroups.make(where)
            _write_all(where, plan.v2_files)
        for controller, files in plan.v1_files.items():
            where = self._v1_dir(controller) / unit
            cgroups.make(where)
            self._v1_unit.setdefault(unit, {})[controller] = where
            if controller == "cpuset":
                _write(where, "cpuset.mems", _read(where.parent, "cpuset.mems"))
            _write_all(where, files)
            procs.append(where / "cgroup.procs")
        self._oom_seen[unit] = self._oom_count(unit) or 0
        return Confinement(tuple(procs), plan.rlimits, plan.cpus, plan.nice, plan.autogroup)

    def _v1_dir(self, controller: str) -> Path:
        """This run's directory in the controller's v1 hierarchy, made at first use."""
        if controller not in self._v1_run:
            assert self._hierarchies is not None
            path = self._hierarchies[controller] / f"dynamod-{self.run_id}"
            cgroups.make(path)
            if controller == "cpuset":  # a new v1 cpuset has no CPUs or nodes: its parent's
                for name in ("cpuset.cpus", "cpuset.mems"):
                    _write(path, name, _read(path.parent, name))
            self._v1_run[controller] = path
        return self._v1_run[controller]

    def _oom_count(self, unit: str) -> int | None:
        plan = self.plans.get(unit)
        memory = plan and (plan.enforced.get("memory_max") or plan.enforced.get("memory_high"))
        if not memory:
            return None
        path: Path | None = None
        if memory.mechanism is Mechanism.CGROUP_V2:
            where = self.containment.unit(unit)
            path = where / "memory.events" if where is not None else None
        elif memory.mechanism is Mechanism.CGROUP_V1 and unit in self._v1_unit:
            path = self._v1_unit[unit]["memory"] / "memory.oom_control"
        try:
            return resources.oom_kill_count(path.read_text()) if path is not None else None
        except OSError:
            return None

    def oom_kills(self, unit: str) -> int:
        """OOM kills in the unit's memory cgroup since its last spawn (0 where unknown).
        Read before its cgroups are removed: the engine asks as it records the exit."""
        count = self._oom_count(unit)
        return max(0, count - self._oom_seen.get(unit, 0)) if count is not None else 0

    def release(self, unit: str) -> None:
        """The unit's processes are gone: remove its v1 cgroups (its v2 one goes with the
        containment's)."""
        for path in self._v1_unit.pop(unit, {}).values():
            if not cgroups.remove_waiting(path, 0.05):
                log.warning("limits.cgroup_left", unit=unit, path=str(path))

    def remove_all(self) -> list[Path]:
        """At the end of the run: every v1 cgroup it made; returns those still there."""
        for unit in list(self._v1_unit):
            self.release(unit)
        left = [path for path in self._v1_run.values() if not cgroups.remove_waiting(path, 1.0)]
        self._v1_run = {}
        return left

    def run_dirs(self) -> list[Path]:
        return list(self._v1_run.values())


def _read(path: Path, name: str) -> str:
    try:
        return (path / name).read_text().strip()
    except OSError as exc:
        raise cgroups.CgroupError(path, f"reading {name}", exc) from exc


def _write(path: Path, name: str, value: str) -> None:
    try:
        (path / name).write_text(value)
    except OSError as exc:
        raise cgroups.CgroupError(path, f"writing {value!r} to {name}", exc) from exc


def _write_all(path: Path, files: Mapping[str, str]) -> None:
    for name, value in files.items():
        _write(path, name, value)


AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def _autogroups(switch: Path = AUTOGROUP_SWITCH) -> bool:
    """Whether the kernel weighs each session as one group (CONFIG_SCHED_AUTOGROUP, on):
    then a unit's nice must be its session's too to order it against other units."""
    try:
        return switch.read_text().strip() == "1" and Path("/proc/self/autogroup").exists()
    except OSError:
        return False
