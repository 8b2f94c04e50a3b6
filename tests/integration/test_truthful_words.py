"""What `down` and the commands that only render say and do when there is little to do
(issue 25, item 5), on a real daemon: a daemon killed during a `down` is said to have died
during it, a stale socket is named as one, `down` of a stack that is already down (or of a
state dir where nothing ever ran) exits 0 saying so, and `check` / `export supervisord`
write nothing at all: no state dir, no logs dir, no port claim."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dynamod.core import runrecord
from tests.conftest import Dynamod, pid_alive, wait_dead

pytestmark = pytest.mark.slow

PROC = '"{python}", "@PROC@"'


def _slow_stop_stack(stack_file: Any) -> Path:
    """One unit that takes 8 s to stop: a `down` of it is in progress for that long."""
    path: Path = stack_file(f"""
        [stack]
        name = "slowstop"
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}", "--stop-delay", "8"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
        stop = {{ timeout = 30 }}
    """)
    return path


def _wait_until(condition: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def test_down_where_nothing_ever_ran_exits_0_and_creates_nothing(dm: Dynamod) -> None:
    result = dm.run("down")
    assert result.returncode == 0, result.stderr
    nobody = f"no dynamod daemon is running for state dir {dm.state_dir}"
    assert result.stdout == f"nothing to stop: {nobody}\n"
    as_json = dm.run("down", "--json")
    assert as_json.returncode == 0 and '"running": false' in as_json.stdout
    assert list(dm.state_dir.iterdir()) == []  # not even the lock file


def test_down_of_a_stack_already_down_exits_0_naming_its_run(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(f"""
        [stack]
        name = "twice"
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
    """)
    dm.run("up", str(stack), "--detach", check=True)
    run_id = dm.run_id()
    first = dm.run("down", check=True)
    assert "nothing left running" in first.stdout
    again = dm.run("down")
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"nothing to stop: stack twice (run {run_id}) is already down\n"
    assert again.stderr == ""


def test_a_daemon_killed_during_down_is_said_to_have_died_during_it(
    dm: Dynamod, stack_file: Any
) -> None:
    dm.run("up", str(_slow_stop_stack(stack_file)), "--detach", check=True)
    status = dm.status()
    daemon, run_id = status["daemon_pid"], status["run_id"]
    units = [u["pid"] for u in status["units"]]
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir), "down"]
    racing = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until(lambda: getattr(runrecord.read(dm.state_dir), "stopping", False),
                "run.json to record that the daemon began its `down`")
    os.kill(daemon, signal.SIGKILL)  # the fault: svc is still in its 8 s stop
    _, err = racing.communicate(timeout=60)
    assert wait_dead([daemon], timeout=10) == []
    assert wait_dead(units, timeout=15) == []  # the guardian ended them
    # The `down` that was waiting sees its daemon vanish and sweeps the dead run itself;
    # if the guardian was quicker, there is nothing left to sweep: then the next one says so.
    follow = dm.run("down")
    said = err + follow.stderr
    assert f"the previous daemon (pid {daemon}, run {run_id}) died during `down`" in said, said
    assert "without `down`" not in said
    assert follow.returncode == 0, follow.stderr

    socket = dm.state_dir / "dynamod.sock"
    assert socket.exists()  # SIGKILL left the daemon's socket behind
    third = dm.run("down")
    assert third.returncode == 0, third.stderr
    assert third.stdout == (
        f"nothing to stop: stack slowstop (run {run_id}) is already down: its daemon "
        f"(pid {daemon}) died, and what it left was swept; {socket} is a stale socket its "
        "daemon left (nothing listens on it)\n"
    )
    status_now = dm.run("status")
    assert status_now.returncode == 1
    assert f"({socket} is a stale socket: nothing listens on it)" in status_now.stderr
    assert "no socket at" not in status_now.stderr
    assert not pid_alive(daemon)


@pytest.fixture
def short_tmp() -> Any:
    """A short folder in /tmp: the default state dir under it must fit a unix socket path,
    which pytest's own tmp_path (deep under /tmp/pytest-of-root/...) may not."""
    path = Path(tempfile.mkdtemp(prefix="dm-render-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _render_env(tmp_path: Path) -> dict[str, str]:
    """No state dir given: the default one under an empty HOME; a port registry of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DYNAMOD_STATE_DIR", "XDG_RUNTIME_DIR", "XDG_STATE_HOME"}}
    (tmp_path / "home").mkdir()
    return {**env, "HOME": str(tmp_path / "home"),
            "DYNAMOD_PORT_REGISTRY": str(tmp_path / "ports")}


@pytest.mark.parametrize("command", [["export", "supervisord", "infra"], ["check", "infra"]])
def test_commands_that_only_render_write_nothing(short_tmp: Path, command: list[str]) -> None:
    tmp_path = short_tmp
    env = _render_env(tmp_path)
    result = subprocess.run([sys.executable, "-m", "dynamod", *command], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[program:etcd]" in result.stdout or "is valid" in result.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["home"]  # no state dir, no claim
    if command[0] == "export":
        logs = tmp_path / "home/.local/state/dynamod/logs"
        assert f"before starting supervisord: mkdir -p {logs}" in result.stderr


def test_up_still_claims_its_ports(tmp_path: Path, dm: Dynamod, stack_file: Any) -> None:
    """The other side of rendering: a stack that runs holds its ports in the registry."""
    registry = tmp_path / "ports"
    stack = stack_file(f"""
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
    """)
    dm.run("up", str(stack), "--detach", check=True,
           env={"DYNAMOD_PORT_REGISTRY": str(registry)})
    port = dm.unit("svc")["ports"]["http"]
    claims = [p.read_text().split() for p in registry.glob("claim-*")]
    assert [str(port)] in claims, claims
