"""A unit's supervising task outlives an unexpected error inside it (issue 16 §1): the
engine on real processes, in a child interpreter (the Reaper owns SIGCHLD there)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """\
    import asyncio, itertools, json, sys
    from pathlib import Path
    import aiohttp
    from dynamod.core import logsetup, process, spec
    from dynamod.core.engine import Engine

    logsetup.configure(sys.stderr, json_output=True)

    state = Path(sys.argv[1])
    stack_file = state / "stack.toml"
    stack_file.write_text('[units.svc]' + chr(10) + 'command = ["sleep", "1000"]' + chr(10))
    ports = itertools.count(41000)
    stack = spec.load(stack_file, state_dir=state, allocate_port=lambda: next(ports))

    class Buggy:  # a hook with a bug: raises the first time a unit comes up
        calls = 0
        async def before_start(self, unit):
            pass
        async def on_ready(self, unit):
            Buggy.calls += 1
            if Buggy.calls == 1:
                raise RuntimeError("bug in a hook")
        async def on_exit(self, unit, exit):
            pass

    async def main():
        reaper = process.Reaper()
        reaper.install(asyncio.get_running_loop())
        seen = []
        async with aiohttp.ClientSession() as session:
            engine = Engine(stack, state_dir=state, run_id="t" * 16,
                            host=process.OsHost("t" * 16, reaper),
                            session=session, hooks=[Buggy()])
            engine.listeners.append(lambda u, old, new: seen.append([str(new), u.detail]))
            engine.start()
            await asyncio.wait_for(engine.wait_up(), 20)
            unit = engine.units["svc"]
            pids = unit.starts
            await engine.stop()
        print(json.dumps({"seen": seen, "starts": pids}))

    asyncio.run(main())
    """
)


def test_an_error_inside_a_lifecycle_does_not_end_supervision(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    states = [state for state, _ in outcome["seen"]]
    assert states[:3] == ["starting", "backoff", "starting"], outcome
    backoff_detail = outcome["seen"][1][1]
    assert backoff_detail == (
        "supervision error: RuntimeError: bug in a hook; starting again in 1s")
    assert "ready" in states and outcome["starts"] == 2
    assert states[-1] == "stopped"
    assert "unit.supervision_error" in result.stderr  # logged, with its traceback
