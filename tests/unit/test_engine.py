"""The engine's whole state machine against a fake ProcessHost: no process is spawned,
exits are delivered as the Reaper delivers them (the engine's callback first, then the
exit future), readiness and liveness come from log probes fed through the unit's output.
Each test asserts the states a unit went through and why. Milliseconds per test; the
delays in the specs are kept small, and timing appears only as lower bounds (a backoff
is never shorter than its delay)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from dynamod.core import spec
from dynamod.core.engine import Engine, Unit, UnitHooks
from dynamod.core.logs import OutputSink
from dynamod.core.process import Child, OnExit, Reaper, TreeStopped
from dynamod.core.resources import Plan
from dynamod.core.restart import Exit
from dynamod.core.spec.models import LimitsSpec
from dynamod.core.state import UnitState

S = UnitState


@dataclass
class FakeHost:
    """A ProcessHost whose processes are futures: a test says when one exits and what it
    prints. Signals end them at once, as a process that obeys its stop signal would."""

    reaper: Reaper = field(default_factory=Reaper)  # never installed: no exec probes here
    spawned: dict[str, list[Child]] = field(default_factory=dict)
    signalled: list[tuple[int, int]] = field(default_factory=list)  # (pid, signal)
    cannot_spawn: dict[str, OSError] = field(default_factory=dict)
    spawn_gate: asyncio.Event | None = None  # set: spawns go through at once
    commands: dict[str, list[list[str]]] = field(default_factory=dict)  # argv per spawn
    ports_taken: set[int] = field(default_factory=set)  # by processes that are not units
    shm_noted: list[str] = field(default_factory=list)  # units noted at their readiness
    _free_ports: Iterator[int] = field(default_factory=lambda: itertools.count(23000))
    _pids: Iterator[int] = field(default_factory=lambda: itertools.count(1000))
    _on_exit: dict[int, OnExit] = field(default_factory=dict)
    _sinks: dict[int, OutputSink] = field(default_factory=dict)

    def cgroup(self, unit: str) -> Path | None:
        return None

    def environment(self, unit: str, extra: Mapping[str, str]) -> dict[str, str]:
        return dict(extra)

    async def spawn(
        self,
        unit: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None,
        on_exit: OnExit,
        limits: LimitsSpec | None = None,
    ) -> Child:
        if self.spawn_gate is not None:
            await self.spawn_gate.wait()
        if unit in self.cannot_spawn:
            raise self.cannot_spawn[unit]
        child = Child(pid=next(self._pids), exited=asyncio.get_running_loop().create_future())
        self._on_exit[child.pid] = on_exit
        self.commands.setdefault(unit, []).append(list(argv))
        self.spawned.setdefault(unit, []).append(child)
        return child

    def attach_output(self, child: Child, sink: OutputSink) -> None:
        self._sinks[child.pid] = sink

    def kill_group_now(self, child: Child) -> None:
        self._signal(child, signal.SIGKILL)

    async def stop_tree(self, unit: str, child: Child, *, sig: int, timeout: float) -> TreeStopped:
        if child.alive:
            self._signal(child, sig)
            await child.wait()
        return TreeStopped(escalated=False, killed_outside_group=0, survivors=[])

    async def note_shm(self, unit: str, child: Child) -> None:
        self.shm_noted.append(unit)

    def unit_pids(self, unit: str, child: Child) -> set[int]:
        return {child.pid}

    def limits(self, unit: str) -> Plan | None:
        return None

    def oom_kills(self, unit: str) -> int:
        return 0

    def port_in_use(self, port: int) -> bool:
        return port in self.ports_taken

    def port_owners(self, port: int, among: set[int] | None = None) -> set[int]:
        return set()

    def allocate_port(self) -> int:
        return next(self._free_ports)

    def command_line(self, pid: int) -> str:
        return "fake"

    # -- what a test does to its processes

    def child(self, unit: str) -> Child:
        return self.spawned[unit][-1]

    def exit(self, unit: str, code: int | None = None, sig: int | None = None) -> None:
        """The unit's current process ends: reaped as the Reaper reaps, callback first."""
        self._reap(self.child(unit), Exit(code=code, signal=sig))

    def say(self, unit: str, line: str) -> None:
        self._sinks[self.child(unit).pid].feed(line.encode() + b"\n")

    def _signal(self, child: Child, sig: int) -> None:
        self.signalled.append((child.pid, sig))
        # the kernel delivers it, the Reaper reaps it in a later step of the loop
        asyncio.get_running_loop().call_soon(self._reap, child, Exit(code=None, signal=sig))

    def _reap(self, child: Child, exit: Exit) -> None:
        if child.exited.done():
            return
        self._on_exit.pop(child.pid)(child, exit)
        child.exited.set_result(exit)


@dataclass
class Run:
    engine: Engine
    host: FakeHost
    seen: list[tuple[str, str, str]]  # (unit, new state, detail) per transition

    def unit(self, name: str) -> Unit:
        return self.engine.units[name]

    def states(self, name: str) -> list[str]:
        return [new for unit, new, _ in self.seen if unit == name]

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
        try:
            async with asyncio.timeout(timeout):  # a hang guard, not a timing assertion
                while not predicate():
                    await self.engine.changed(0.01)
        except TimeoutError:
            pytest.fail(f"never happened: {what}; transitions: {self.seen}")

    async def entered(self, name: str, state: UnitState, nth: int = 1) -> str:
        """Wait until the unit entered `state` for the nth time (it may have left it since:
        a short backoff is over before a loaded machine runs the test again); the detail
        it entered with."""
        details = lambda: [d for unit, new, d in self.seen if unit == name and new == state]  # noqa: E731
        await self.until(lambda: len(details()) >= nth, f"{name} {state} #{nth}")
        return details()[nth - 1]

    async def reach(self, name: str, state: UnitState) -> Unit:
        unit = self.unit(name)
        await self.until(lambda: unit.state is state, f"{name} {state} (is {unit.state})")
        return unit


@asynccontextmanager
async def running(
    tmp_path: Path, units: str, *, hooks: Iterable[UnitHooks] = (), host: FakeHost | None = None
) -> AsyncIterator[Run]:
    path = tmp_path / "stack.toml"
    path.write_text(units)
    ports = itertools.count(20000)
    stack = spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(ports))
    host = host or FakeHost()
    async with aiohttp.ClientSession() as session:
        engine = Engine(
            stack,
            state_dir=tmp_path / "state",
            run_id="t" * 16,
            host=host,
            session=session,
            hooks=hooks,
        )
        seen: list[tuple[str, str, str]] = []
        engine.listeners.append(lambda u, old, new: seen.append((u.name, str(new), u.detail)))
        engine.start()
        try:
            yield Run(engine, host, seen)
        finally:
            await engine.stop()


def service(name: str, extra: str = "", **restart: object) -> str:
    """A unit's TOML: fast restarts without jitter unless `restart` says otherwise."""
    settings = {"first_delay": 0, "backoff_initial": 0.01, "jitter": 0, "min_uptime": 0.02}
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**settings, **restart}.items())
    return (
        f'[units.{name}]\ncommand = ["{name}"]\n{extra}\n'
        f"[units.{name}.restart]\n{table}\n[units.{name}.stop]\ntimeout = 1\n"
    )


READY_ON_LOG = 'ready = { kind = "log", pattern = "listening", interval = 0.005, deadline = 5 }'


# ------------------------------------------------------------------ readiness


async def test_a_log_line_makes_the_unit_ready(tmp_path: Path) -> None:
    async with running(tmp_path, service("app", READY_ON_LOG)) as run:
        await run.reach("app", S.STARTING)
        assert run.unit("app").ready_at is None
        run.host.say("app", "still loading")
        run.host.say("app", "listening on 8000")
        unit = await run.reach("app", S.READY)
        assert run.states("app") == ["starting", "ready"]
        assert unit.detail == "log line matched /listening/: listening on 8000"
        assert unit.ready_at is not None and unit.tracker.total == 0
        assert run.host.shm_noted == ["app"]  # what it holds in /dev/shm, noted (shmleft)


async def test_without_a_probe_the_unit_is_ready_after_min_uptime(tmp_path: Path) -> None:
    async with running(tmp_path, service("app")) as run:
        unit = await run.reach("app", S.READY)
        assert run.states("app") == ["starting", "ready"]
        assert unit.detail == "running (no readiness probe; up 0.02s)"


async def test_not_ready_by_the_deadline_is_killed_and_restarted(tmp_path: Path) -> None:
    probe = 'ready = { kind = "log", pattern = "listening", interval = 0.005, deadline = 0.05 }'
    async with running(tmp_path, service("app", probe, first_delay=0.05)) as run:
        detail = await run.entered("app", S.BACKOFF)
        first = run.host.spawned["app"][0]
        assert (first.pid, signal.SIGKILL) in run.host.signalled
        # the deadline cuts an attempt in flight, or falls between two
        assert detail.startswith("killed by SIGKILL (not ready within 0.05s")
        assert detail.endswith(
            "last probe: no log line matching /listening/ yet); restarting in 0.05s (restart 1)"
        )
        # the host records the spawn before the engine records the transition: wait for both
        await run.until(lambda: len(run.host.spawned["app"]) == 2, "a second start")
        await run.entered("app", S.STARTING, nth=2)
        assert run.states("app")[:3] == ["starting", "backoff", "starting"]


async def test_an_exit_before_ready_fails_even_with_status_0(tmp_path: Path) -> None:
    async with running(tmp_path, service("app", READY_ON_LOG, first_delay=5)) as run:
        await run.reach("app", S.STARTING)
        run.host.say("app", "loading weights")
        await run.until(lambda: run.unit("app").detail != "spawned pid 1000", "a probe answer")
        run.host.exit("app", code=0)
        unit = await run.reach("app", S.BACKOFF)
        assert unit.detail == (
            "exited with status 0 (exited before it was ready; last probe: no log line"
            " matching /listening/ yet); restarting in 5.00s (restart 1)"
        )
        assert unit.last_exit == Exit(code=0, signal=None)


async def test_an_exit_within_min_uptime_says_so(tmp_path: Path) -> None:
    async with running(tmp_path, service("app", policy="never", min_uptime=5)) as run:
        await run.reach("app", S.STARTING)
        run.host.exit("app", code=0)
        unit = await run.reach("app", S.FAILED)
        assert unit.detail == (
            "exited with status 0 (exited within min_uptime 5s, before it counted as ready);"
            " restart policy 'never' does not restart it"
        )
        assert run.states("app") == ["starting", "failed"]


async def test_a_unit_that_cannot_start_fails_with_the_reason(tmp_path: Path) -> None:
    host = FakeHost(cannot_spawn={"app": FileNotFoundError(2, "No such file or directory")})
    async with running(tmp_path, service("app"), host=host) as run:
        unit = await run.reach("app", S.FAILED)
        assert unit.detail == "cannot start 'app': No such file or directory"
        assert run.states("app") == ["failed"] and unit.starts == 0


# ------------------------------------------------------------------ exits and restarts


@pytest.mark.parametrize(
    ("policy", "code", "state"),
    [
        ("never", 1, S.FAILED),
        ("never", 0, S.COMPLETED),
        ("on-failure", 1, S.BACKOFF),
        ("on-failure", 0, S.COMPLETED),
        ("always", 1, S.BACKOFF),
        ("always", 0, S.BACKOFF),
    ],
)
async def test_restart_policy_after_ready(
    tmp_path: Path, policy: str, code: int, state: UnitState
) -> None:
    units = service("app", policy=policy, clean_exit_final=True, first_delay=5)
    async with running(tmp_path, units) as run:
        await run.reach("app", S.READY)
        run.host.exit("app", code=code)
        unit = await run.reach("app", state)
        assert run.states("app") == ["starting", "ready", str(state)]
        assert unit.tracker.total == (1 if state is S.BACKOFF else 0)
        if state is S.FAILED:
            assert unit.detail == "exited with status 1; restart policy 'never' does not restart it"
        if state is S.COMPLETED:
            assert unit.detail == "exited with status 0"


async def test_a_clean_exit_after_ready_is_a_failure_unless_clean_exit_final(
    tmp_path: Path,
) -> None:
    units = service("final", clean_exit_final=True) + service("service", first_delay=5)
    async with running(tmp_path, units) as run:
        await run.reach("final", S.READY)
        await run.reach("service", S.READY)
        run.host.exit("final", code=0)
        run.host.exit("service", code=0)
        assert (await run.reach("final", S.COMPLETED)).detail == "exited with status 0"
        service_unit = await run.reach("service", S.BACKOFF)
        assert service_unit.detail == "exited with status 0; restarting in 5.00s (restart 1)"


async def test_backoff_grows_and_the_restart_limit_fails_the_unit(tmp_path: Path) -> None:
    units = service(
        "app",
        first_delay=0.03,
        backoff_initial=0.06,
        limit_burst=2,
        limit_interval=60,
        min_uptime=5,
    )
    exited_at: list[float] = []
    async with running(tmp_path, units) as run:
        for starts in (1, 2):
            await run.until(
                lambda n=starts: (
                    len(run.host.spawned.get("app", [])) == n
                    and run.unit("app").state is S.STARTING
                ),
                f"start #{starts}",
            )
            exited_at.append(time.monotonic())
            run.host.exit("app", code=3)
        await run.until(lambda: len(run.host.spawned["app"]) == 3, "start #3")
        run.host.exit("app", code=3)
        unit = await run.reach("app", S.FAILED)
        assert unit.detail == (
            "exited with status 3 (exited within min_uptime 5s, before it counted as ready);"
            " restart limit reached: 2 restarts within 60s (limit_burst=2)"
        )
        assert unit.starts == 3 and unit.tracker.total == 2
        backoffs = [d for name, new, d in run.seen if new == "backoff"]
        assert [d.rsplit("; ", 1)[1] for d in backoffs] == [
            "restarting in 0.03s (restart 1)",
            "restarting in 0.06s (restart 2)",
        ]
        # from the exit to the next spawn: never shorter than the delay it said
        respawned = [child.started_at for child in run.host.spawned["app"][1:]]
        waited = [spawn - exit for exit, spawn in zip(exited_at, respawned, strict=True)]
        assert waited[0] >= 0.03 and waited[1] >= 0.06
        assert run.states("app") == [
            "starting",
            "backoff",
            "starting",
            "backoff",
            "starting",
            "failed",
        ]


async def test_past_the_limit_without_give_up_it_retries_at_backoff_max(tmp_path: Path) -> None:
    units = service("app", limit_burst=1, give_up=False, backoff_max=0.02, min_uptime=5)
    async with running(tmp_path, units) as run:
        await run.reach("app", S.STARTING)
        run.host.exit("app", code=1)
        await run.until(lambda: len(run.host.spawned["app"]) == 2, "a second start")
        await run.reach("app", S.STARTING)
        run.host.exit("app", code=1)
        detail = await run.entered("app", S.BACKOFF, nth=2)
        assert detail.endswith(
            "restart limit reached: 1 restarts within 60s (limit_burst=1); retrying in 0.02s"
            " (restart 2)"
        )
        await run.until(lambda: len(run.host.spawned["app"]) == 3, "a third start")


async def test_an_exit_while_a_dependency_is_away_waits_and_is_not_counted(
    tmp_path: Path,
) -> None:
    units = service("db", first_delay=0.05) + service("app", 'depends_on = { db = "ready" }')
    async with running(tmp_path, units) as run:
        await run.reach("db", S.READY)
        await run.reach("app", S.READY)
        run.host.exit("db", code=1)  # e.g. etcd dies: the app loses its lease and exits
        run.host.exit("app", code=1)
        assert await run.entered("app", S.WAITING) == (
            "exited with status 1; waiting for db (ready) (not counted as a restart)"
        )
        app = run.unit("app")
        assert app.tracker.total == 0 and run.unit("db").tracker.total == 1
        await run.reach("db", S.READY)
        await run.reach("app", S.READY)
        assert run.states("app") == ["starting", "ready", "waiting", "starting", "ready"]
        assert app.tracker.total == 0 and app.starts == 2


async def test_a_dependency_that_failed_fails_its_dependents(tmp_path: Path) -> None:
    units = service("db", policy="never", min_uptime=5) + service(
        "app", 'depends_on = { db = "ready" }'
    )
    async with running(tmp_path, units) as run:
        await run.reach("db", S.STARTING)
        assert run.unit("app").state is S.INACTIVE  # not started before db is ready
        run.host.exit("db", code=1)
        app = await run.reach("app", S.FAILED)
        assert app.detail.startswith("dependency db is failed: exited with status 1")
        assert "app" not in run.host.spawned


async def test_a_oneshot_completes_and_its_dependent_starts(tmp_path: Path) -> None:
    units = service("migrate", 'type = "oneshot"') + service(
        "app", 'depends_on = { migrate = "completed" }'
    )
    async with running(tmp_path, units) as run:
        await run.reach("migrate", S.STARTING)
        run.host.exit("migrate", code=0)
        await run.reach("migrate", S.COMPLETED)
        await run.reach("app", S.READY)
        assert run.states("migrate") == ["starting", "completed"]


# ------------------------------------------------------------------ liveness


async def test_liveness_failures_degrade_then_kill_and_restart(tmp_path: Path) -> None:
    live = 'live = { kind = "log", pattern = "alive", interval = 0.005, failure_threshold = 3 }'
    lost: list[str] = []
    async with running(tmp_path, service("app", live, first_delay=5)) as run:
        run.engine.lost_listeners.append(lambda unit, why: lost.append(why))
        unit = await run.reach("app", S.BACKOFF)
        assert run.states("app") == ["starting", "ready", "degraded", "backoff"]
        details = [d for name, new, d in run.seen if name == "app" and new == "degraded"]
        assert details[0] == "liveness 1/3: no log line matching /alive/ yet"
        assert lost == [
            "liveness failed 3 times in a row: no log line matching /alive/ yet; killed"
        ]
        assert (run.host.spawned["app"][0].pid, signal.SIGKILL) in run.host.signalled
        assert unit.detail == f"killed by SIGKILL ({lost[0]}); restarting in 5.00s (restart 1)"


async def test_liveness_that_recovers_goes_back_to_ready(tmp_path: Path) -> None:
    live = 'live = { kind = "log", pattern = "alive", interval = 0.005, failure_threshold = 1000 }'
    async with running(tmp_path, service("app", live)) as run:
        await run.reach("app", S.DEGRADED)
        run.host.say("app", "alive")
        unit = await run.reach("app", S.READY)
        assert run.states("app") == ["starting", "ready", "degraded", "ready"]
        assert unit.detail == "log line matched /alive/: alive" and unit.tracker.total == 0


# ------------------------------------------------------------------ hold and admit


class Shard:
    """A rollout policy in small: holds a shard once ready until it has caught up."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.caught_up = asyncio.Event()

    async def before_start(self, unit: Unit) -> None:
        pass

    async def on_ready(self, unit: Unit) -> None:
        assert self.engine is not None
        self.engine.hold(unit, "held: waiting to replay the current policy")
        await self.caught_up.wait()

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        pass


async def test_a_held_shard_is_admitted_once_it_caught_up(tmp_path: Path) -> None:
    shard = Shard()
    async with running(tmp_path, service("worker"), hooks=[shard]) as run:
        shard.engine = run.engine
        unit = await run.reach("worker", S.HELD)
        assert unit.detail == "held: waiting to replay the current policy"
        assert unit.hold_reason is not None and unit.ready_at is None
        shard.caught_up.set()
        await run.reach("worker", S.READY)
        assert unit.hold_reason is None and unit.ready_at is not None
        run.engine.hold(unit, "held: node lost and back")  # a rejoin
        assert unit.state is S.HELD
        run.engine.admit(unit, "caught up to version 7")
        assert unit.state is S.READY and unit.detail == "caught up to version 7"
        assert run.states("worker") == ["starting", "held", "ready", "held", "ready"]


async def test_an_exit_while_held_ends_the_hold_and_restarts(tmp_path: Path) -> None:
    shard = Shard()
    async with running(tmp_path, service("worker", first_delay=0.05), hooks=[shard]) as run:
        shard.engine = run.engine
        holds: list[tuple[str, str | None]] = []
        run.engine.listeners.append(lambda u, old, new: holds.append((new, u.hold_reason)))
        await run.reach("worker", S.HELD)
        run.host.exit("worker", code=1)
        detail = await run.entered("worker", S.BACKOFF)
        assert [h for h in holds if h[0] != "starting"][:2] == [
            ("held", "held: waiting to replay the current policy"),
            ("backoff", None),
        ]
        assert detail == (
            "exited with status 1 (exited within min_uptime 0.02s, before it counted as ready);"
            " restarting in 0.05s (restart 1)"
        )
        await run.reach("worker", S.HELD)  # the next start is held again
        assert run.states("worker")[:4] == ["starting", "held", "backoff", "starting"]


# ------------------------------------------------------------------ stop


async def test_stop_during_start_stops_the_process_and_never_restarts(tmp_path: Path) -> None:
    async with running(tmp_path, service("app", READY_ON_LOG)) as run:
        await run.reach("app", S.STARTING)
        assert await run.engine.stop() == []
        unit = run.unit("app")
        assert unit.state is S.STOPPED and unit.detail.startswith("stopped in ")
        assert unit.detail.endswith("s (killed by SIGTERM)")
        assert run.host.signalled == [(run.host.child("app").pid, signal.SIGTERM)]
        assert run.states("app") == ["starting", "stopping", "stopped"]
        assert len(run.host.spawned["app"]) == 1 and unit.tracker.total == 0


async def test_stop_during_the_spawn_still_ends_the_process_being_started(
    tmp_path: Path,
) -> None:
    host = FakeHost(spawn_gate=asyncio.Event())
    async with running(tmp_path, service("app"), host=host) as run:
        await asyncio.sleep(0.01)  # the lifecycle is inside the spawn now
        assert "app" not in host.spawned
        stopping = asyncio.ensure_future(run.engine.stop())
        await asyncio.sleep(0.01)
        host.spawn_gate.set()  # the fork completes after the stop began
        await stopping
        child = host.child("app")
        assert run.unit("app").state is S.STOPPED and not child.alive
        assert host.signalled == [(child.pid, signal.SIGTERM)]
        assert run.states("app") == ["starting", "stopping", "stopped"]


# ------------------------------------------------------------------ ports


async def test_a_port_taken_while_the_unit_was_down_moves_and_its_users_restart(
    tmp_path: Path,
) -> None:
    units = """
[units.db]
command = ["db", "{ports.client}"]
ports = { client = 0 }
restart = { first_delay = 0, jitter = 0, min_uptime = 0.02 }

[units.app]
command = ["app", "{units.db.ports.client}"]
env = { DB = "{units.db.ports.client}" }
depends_on = { db = "started" }
restart = { first_delay = 0, jitter = 0, min_uptime = 0.02 }
"""
    async with running(tmp_path, units) as run:
        await run.reach("app", S.READY)
        old = run.unit("db").spec.ports["client"]
        assert run.host.commands == {"db": [["db", str(old)]], "app": [["app", str(old)]]}
        run.host.ports_taken.add(old)  # something else binds it while db is down
        run.host.exit("db", code=1)
        await run.until(lambda: len(run.host.commands["app"]) == 2, "app started again")
        await run.reach("app", S.READY)
        assert run.host.commands["db"][1] == ["db", "23000"]
        assert run.host.commands["app"][1] == ["app", "23000"]
        assert run.unit("app").spec.env["DB"] == "23000"
        assert run.states("app") == [
            "starting",
            "ready",
            "stopping",
            "stopped",
            "starting",
            "ready",
        ]
        assert run.unit("app").tracker.total == 0  # an operator-style restart, not a failure


# ------------------------------------------------------------------ operator stop / start


async def test_an_operator_stop_holds_the_unit_and_its_dependents_wait(tmp_path: Path) -> None:
    units = service("db") + service("app", 'depends_on = { db = "ready" }')
    async with running(tmp_path, units) as run:
        await run.reach("db", S.READY)
        await run.reach("app", S.READY)
        await run.engine.hold_stopped("db", "`dynamod stop`")
        db = run.unit("db")
        assert db.state is S.STOPPED
        assert db.detail.startswith("stopped by `dynamod stop`: stopped in ")
        assert (run.host.child("db").pid, signal.SIGTERM) in run.host.signalled
        run.host.exit("app", code=1)  # it loses what it needs
        assert "waiting for db (ready)" in await run.entered("app", S.WAITING)
        await asyncio.sleep(0.1)  # many times db's backoff: it is not started again
        assert db.state is S.STOPPED and len(run.host.spawned["db"]) == 1
        assert db.tracker.total == 0 and run.unit("app").tracker.total == 0
        row = next(r for r in run.engine.snapshot() if r["name"] == "db")
        assert row["operator_stop"]["by"] == "`dynamod stop`"
        assert row["detail"].startswith("stopped by `dynamod stop` 0 s ago; stopped in ")
        run.engine.release("db")
        await run.reach("db", S.READY)
        await run.reach("app", S.READY)
        assert len(run.host.spawned["db"]) == 2 and db.operator_stop is None
        assert run.states("db") == ["starting", "ready", "stopping", "stopped", "starting", "ready"]


async def test_a_restart_starts_an_operator_stopped_unit(tmp_path: Path) -> None:
    async with running(tmp_path, service("app")) as run:
        await run.reach("app", S.READY)
        await run.engine.hold_stopped("app", "`dynamod stop`")
        await run.engine.restart_unit("app")
        unit = await run.reach("app", S.READY)
        assert unit.operator_stop is None and len(run.host.spawned["app"]) == 2


# ------------------------------------------------------------------ start slots


def _spawned(run: Run, *names: str) -> list[str]:
    return [n for n in names if n in run.host.spawned]


async def test_max_starting_lets_that_many_start_and_the_rest_wait_their_turn(
    tmp_path: Path,
) -> None:
    names = ["a", "b", "c", "d"]
    units = "[stack]\nmax_starting = 2\n" + "".join(service(n, READY_ON_LOG) for n in names)
    async with running(tmp_path, units) as run:
        await run.until(lambda: len(_spawned(run, *names)) == 2, "two spawns")
        await asyncio.sleep(0.05)  # many probe intervals: no third start
        assert _spawned(run, *names) == ["a", "b"]
        for name in ["c", "d"]:
            unit = run.unit(name)
            assert unit.state is S.INACTIVE
            assert unit.detail == "waiting for a start slot (2 of max_starting 2 starting: a, b)"
        run.host.say("b", "listening")  # b is started: its slot goes to c, first in line
        await run.reach("b", S.READY)
        await run.until(lambda: "c" in run.host.spawned, "c spawned")
        assert "d" not in run.host.spawned and run.engine.start_slots.holders == ["a", "c"]
        run.host.exit("a", code=1)  # a start that fails gives its slot back too
        await run.until(lambda: "d" in run.host.spawned, "d spawned")
        # a's restart waits behind d, with the deadline of a fresh start
        await run.until(lambda: run.unit("a").detail.startswith("waiting for a start"), "a waits")
        assert run.unit("a").state is S.BACKOFF and len(run.host.spawned["a"]) == 1
        run.host.say("c", "listening")
        await run.until(lambda: len(run.host.spawned["a"]) == 2, "a started again")
        for name in ["a", "d"]:
            run.host.say(name, "listening")
        for name in names:
            await run.reach(name, S.READY)
        assert run.engine.start_slots.holders == [] and run.engine.start_slots.waiting == []


async def test_without_max_starting_every_unit_starts_at_once(tmp_path: Path) -> None:
    """The control for the test above: the same stack without the limit."""
    names = ["a", "b", "c", "d"]
    async with running(tmp_path, "".join(service(n, READY_ON_LOG) for n in names)) as run:
        await run.until(lambda: len(_spawned(run, *names)) == 4, "four spawns")
        assert all(run.unit(n).state is S.STARTING for n in names)


async def test_a_oneshot_holds_its_slot_until_it_exits(tmp_path: Path) -> None:
    units = "[stack]\nmax_starting = 1\n" + service("job", 'type = "oneshot"') + service("app")
    async with running(tmp_path, units) as run:
        await run.reach("job", S.STARTING)
        await asyncio.sleep(0.05)  # app's min_uptime many times over
        assert "app" not in run.host.spawned
        run.host.exit("job", code=0)
        await run.reach("app", S.READY)


async def test_the_hooks_after_readiness_run_without_a_slot(tmp_path: Path) -> None:
    """A shard held for its replay (which may wait on the ledger) does not hold up starts."""
    release = asyncio.Event()

    class Replay:
        async def before_start(self, unit: Unit) -> None:
            pass

        async def on_ready(self, unit: Unit) -> None:
            if unit.name == "a":
                await release.wait()

        async def on_exit(self, unit: Unit, exit: Exit) -> None:
            pass

    units = "[stack]\nmax_starting = 1\n" + service("a") + service("b")
    async with running(tmp_path, units, hooks=[Replay()]) as run:
        await run.reach("b", S.READY)
        assert run.unit("a").state is S.STARTING  # still in its hook
        release.set()
        await run.reach("a", S.READY)


async def test_before_start_runs_before_each_spawn_and_a_held_one_holds_the_spawn(
    tmp_path: Path,
) -> None:
    """`before_start` runs before every start, a restart's too, with nothing spawned yet
    (the registrations' start-up sweep before the first worker), and outside the start
    slots: a unit whose hook waits holds up no other start."""
    release = asyncio.Event()
    seen: list[tuple[str, int]] = []

    class Sweep:
        async def before_start(self, unit: Unit) -> None:
            seen.append((unit.name, len(run.host.spawned.get(unit.name, []))))
            if unit.name == "a":
                await release.wait()

        async def on_ready(self, unit: Unit) -> None:
            pass

        async def on_exit(self, unit: Unit, exit: Exit) -> None:
            pass

    units = "[stack]\nmax_starting = 1\n" + service("a") + service("b")
    async with running(tmp_path, units, hooks=[Sweep()]) as run:
        await run.reach("b", S.READY)  # a's hook waits: b starts all the same
        assert "a" not in run.host.spawned and ("a", 0) in seen
        release.set()
        await run.reach("a", S.READY)
        run.host.exit("a", code=1)
        await run.until(lambda: len(run.host.spawned.get("a", [])) == 2, "a started again")
        assert [n for n in seen if n[0] == "a"] == [("a", 0), ("a", 1)]


async def test_a_stop_while_waiting_for_a_slot_starts_nothing(tmp_path: Path) -> None:
    units = "[stack]\nmax_starting = 1\n" + service("a", READY_ON_LOG) + service("b")
    async with running(tmp_path, units) as run:
        await run.reach("a", S.STARTING)
        await run.until(lambda: run.engine.start_slots.waiting == ["b"], "b in line")
        await run.engine.stop()
        assert "b" not in run.host.spawned and run.unit("b").state is S.STOPPED
        assert run.engine.start_slots.holders == [] and run.engine.start_slots.waiting == []


async def test_a_raised_limit_lets_the_waiting_start(tmp_path: Path) -> None:
    units = "[stack]\nmax_starting = 1\n" + service("a", READY_ON_LOG) + service("b")
    async with running(tmp_path, units) as run:
        await run.until(lambda: run.engine.start_slots.waiting == ["b"], "b in line")
        run.engine.start_slots.set_limit(2)  # as `adopt` does when apply raises it
        await run.reach("b", S.READY)
        assert run.unit("a").state is S.STARTING
