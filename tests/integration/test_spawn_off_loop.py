"""Units are forked off the event loop (issue 9 §3): a unit killed while another unit's
process is being spawned is still reaped and its state change recorded during that spawn,
and a stop that lands during a spawn still ends the process being started. The engine on
real processes, in a child interpreter (the Reaper owns SIGCHLD there); the spawn is held
open by a gate inside the spawner thread, so the overlap is certain, not a matter of luck.
Correctness only: nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dynamod.core import cgroups
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

_BASE, _WHY = cgroups.own_cgroup_dir()
HAVE_CGROUPS = _BASE is not None and os.access(_BASE, os.W_OK)

SCRIPT = textwrap.dedent(
    """\
    import asyncio, itertools, json, os, signal, sys, threading
    from pathlib import Path
    import aiohttp
    from dynamod.core import cgroups, logsetup, process, spec
    from dynamod.core.engine import Engine
    from dynamod.core.state import UnitState

    logsetup.configure(sys.stderr, json_output=True)
    state, mode, scenario = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (state / "stack.toml").write_text(
        "".join(
            f'[units.{name}]\\ncommand = ["sleep", "1000"]\\n'
            f'[units.{name}.restart]\\npolicy = "always"\\nmin_uptime = 0.1\\n'
            f'[units.{name}.stop]\\ntimeout = 2\\n'
            for name in ("a", "b")
        )
    )
    ports = itertools.count(41000)
    stack = spec.load(state / "stack.toml", state_dir=state, allocate_port=lambda: next(ports))
    run_id = "s" * 16

    # The gate: b's second start waits in the spawner thread until the test lets it go
    # (or 20 s pass). `on_hold` runs there while it waits.
    entered, release, spawned = threading.Event(), threading.Event(), threading.Event()
    armed = {"b": False}
    on_hold = []
    real_popen = process._popen

    def gated_popen(argv, env, *args):
        if env.get("DYNAMOD_UNIT") == "b" and armed["b"]:
            armed["b"] = False
            entered.set()
            for action in on_hold:
                action()
            release.wait(20)
            try:
                return real_popen(argv, env, *args)
            finally:
                spawned.set()
        return real_popen(argv, env, *args)

    process._popen = gated_popen

    async def until(predicate, what):
        async def poll():
            while not predicate():
                await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(poll(), 30)  # a hang guard, not a timing assertion
        except TimeoutError:
            raise SystemExit(f"never happened: {what}")

    async def main():
        loop = asyncio.get_running_loop()
        reaper = process.Reaper()
        reaper.install(loop)
        process.become_subreaper()
        containment = cgroups.detect(run_id) if mode == "cgroup" else None
        out = {}
        async with aiohttp.ClientSession() as session:
            engine = Engine(stack, state_dir=state, run_id=run_id,
                            host=process.OsHost(run_id, reaper, containment),
                            session=session)
            a, b = engine.units["a"], engine.units["b"]
            seen = []

            def listener(unit, old, new):
                during = entered.is_set() and not spawned.is_set()
                seen.append([unit.name, str(old), str(new), during])
                if unit is a and new is UnitState.BACKOFF and during:
                    release.set()  # a's exit was recorded while b was being spawned

            engine.listeners.append(listener)
            engine.start()
            await asyncio.wait_for(engine.wait_up(), 30)
            a_pid, b_pid = a.pid, b.pid
            out["first_pids"] = [a_pid, b_pid]
            armed["b"] = True
            if scenario == "kill":
                on_hold.append(lambda: os.kill(a_pid, signal.SIGKILL))
                os.kill(b_pid, signal.SIGKILL)
                await until(lambda: spawned.is_set(), "b spawned again")
                await until(lambda: a.starts == 2 and b.starts == 2 and engine.all_up(),
                            "both units up again")
                out["a_last_exit"] = a.last_exit.describe() if a.last_exit else None
                out["second_pids"] = [a.pid, b.pid]
            else:  # stop: `restart b` begins while b's next process is being spawned
                os.kill(b_pid, signal.SIGKILL)
                await until(lambda: entered.is_set(), "b's spawn under way")
                stopping = asyncio.ensure_future(engine.stop_unit(b))
                await asyncio.sleep(0.2)
                out["stop_done_before_spawn"] = stopping.done()
                release.set()
                await stopping
                out["b_state"] = str(b.state)
                out["b_child"] = b.child.pid if b.child else None
                out["b_child_alive"] = bool(b.child and b.child.alive)
            out["seen"] = seen
            out["survivors"] = await engine.stop()
            out["orphans"] = reaper.orphans(process.children_of(os.getpid()))
            if containment is not None and containment.root is not None:
                out["cgroup_left"] = cgroups.procs(containment.root)
                cgroups.remove(containment.root)
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def _run(tmp_path: Path, mode: str, scenario: str) -> dict[str, object]:
    if mode == "cgroup" and not HAVE_CGROUPS:
        pytest.skip(f"no writable cgroup v2 hierarchy here: {_WHY or 'not writable'}")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode, scenario],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return outcome


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("mode", ["cgroup", "pgroup"])
def test_a_kill_during_a_spawn_is_recorded_during_it(tmp_path: Path, mode: str) -> None:
    out = _run(tmp_path, mode, "kill")
    seen = out["seen"]
    assert isinstance(seen, list)
    # a's exit: reaped and recorded (ready -> backoff) while b's spawn was still in flight
    a_exits = [s for s in seen if s[0] == "a" and s[1] == "ready" and s[2] == "backoff"]
    assert a_exits and a_exits[0][3] is True, seen
    assert out["a_last_exit"] == "killed by SIGKILL"
    # both supervised again afterwards, with new processes; nothing left behind
    first, second = out["first_pids"], out["second_pids"]
    assert isinstance(first, list) and isinstance(second, list)
    assert all(second) and not set(first) & set(second), (first, second)
    assert out["survivors"] == [] and out["orphans"] == []
    assert out.get("cgroup_left", []) == []
    assert all(_gone(pid) for pid in [*first, *second])


@pytest.mark.parametrize("mode", ["cgroup", "pgroup"])
def test_a_stop_during_a_spawn_ends_the_process_being_started(tmp_path: Path, mode: str) -> None:
    out = _run(tmp_path, mode, "stop")
    assert out["stop_done_before_spawn"] is False  # the stop waited for the spawn
    assert out["b_state"] == "stopped"
    pid = out["b_child"]
    assert isinstance(pid, int)  # the process started during the stop was kept ...
    assert out["b_child_alive"] is False  # ... and ended by it
    assert _gone(pid)
    assert out["survivors"] == [] and out["orphans"] == []
    assert out.get("cgroup_left", []) == []
