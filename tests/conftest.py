"""Shared fixtures: short state dirs, a CLI runner, and a safety net that ends anything a
test's dynamod left behind (by pid / by the run's env marker, never by name)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos.cluster import ClusterRig
from dynamod.client import Client, UnitStatus
from dynamod.control import tables
from dynamod.core import runrecord
from dynamod.core.errors import DaemonError
from dynamod.core.proctable import marked_pids

# Stack files in tests use the rollout layer's tables ([policy], dynamo) as dynamod's own
# entry points do: the CLI and the daemon register them before a stack is read.
tables.register()

pytest_plugins = ["tests.xdist_groups"]  # each module's tests on one xdist worker

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROC = FIXTURES / "proc.py"


# Processes the tests start outside dynamod (raw stacks, benchmarks' supervisord and plain
# runs, Ray, verl) write to TMPDIR and are often killed: Dynamo alone wrote a logging-config
# tmpXXXX.json per process start, ~50 an hour of test runs left in /tmp. They get one
# directory for the session, removed at its end; this process keeps /tmp (pytest's own
# tmp_path, and the tests that look at /tmp for what a stack leaked). Units under dynamod
# have their own TMPDIR in the state dir whatever this says.
_SESSION_TMP = "DYNAMOD_TEST_SESSION_TMP"


def pytest_configure(config: pytest.Config) -> None:
    tempfile.gettempdir()  # fixed now, before TMPDIR changes: /tmp for this process
    if _SESSION_TMP not in os.environ:  # the xdist controller's; its workers inherit it
        session = tempfile.mkdtemp(prefix="dynamod-tests-")
        os.environ[_SESSION_TMP] = os.environ["TMPDIR"] = session
        config.stash[_session_key] = session


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_session_key, None)
    if session is not None:
        shutil.rmtree(session, ignore_errors=True)


_session_key = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item, so a fixture's teardown knows it failed. A
    failed test on a simulated cluster (a `rig` argument) keeps the rig's logs, which its
    module's fixture would remove (a test's failure does not raise through the fixture),
    and its report shows where, with each node's last warnings and cluster events."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)
    rig = getattr(item, "funcargs", {}).get("rig")
    if report.failed and isinstance(rig, ClusterRig):
        rig.keep = True
        report.sections.append(("the simulated cluster's logs", rig.digest()))


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


class Dynamod:
    """Runs the real `dynamod` CLI against one state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def run(self, *args: str, timeout: float = 120, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(self.state_dir), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, **(env or {})})
        if check and result.returncode != 0:
            raise AssertionError(
                f"dynamod {' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def status(self) -> dict[str, Any]:
        """What `status --json` prints (the CLI prints this answer as it is), asked over the
        control socket from this process: tests poll it every 0.1 s, and a CLI start per poll
        cost ~0.25 CPU-s, most of a core while a test waited. The CLI's own `status` has its
        tests (test_cli.py, test_local_stack.py)."""
        try:
            data: dict[str, Any] = Client(self.state_dir).status()
        except DaemonError as exc:
            raise AssertionError(f"dynamod status failed: {exc}") from None
        return data

    def unit(self, name: str) -> dict[str, Any]:
        for unit in self.status()["units"]:
            if unit["name"] == name:
                return dict(unit)
        raise KeyError(name)

    def wait_for(self, predicate: Any, timeout: float = 30, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
            except AssertionError:
                last = None
            if last is not None:
                value = predicate(last)
                if value:
                    return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last status: "
                             f"{json.dumps(last, indent=1)[:3000] if last else None}")

    def wait_ready_again(self, name: str, *old_pids: int, timeout: float = 30,
                         what: str = "") -> dict[str, Any]:
        """Until unit `name` is ready under a pid that is none of `old_pids` (a restart)."""
        def ready_again(status: dict[str, Any]) -> dict[str, Any] | None:
            unit = unit_by_name(status, name)
            ready = unit["state"] == "ready" and unit["pid"] not in old_pids
            return unit if ready else None

        result: dict[str, Any] = self.wait_for(ready_again, timeout=timeout,
                                               what=what or f"{name} ready again")
        return result

    def run_id(self) -> str | None:
        run = runrecord.read(self.state_dir)
        return run.run_id if run is not None else None

    def daemon_log(self) -> str:
        path = self.state_dir / "daemon.log"
        return path.read_text() if path.exists() else ""

    def print_log_tail(self, lines: int) -> None:
        """The daemon log's last `lines` on stdout (CI keeps a failed test's output)."""
        have = self.daemon_log().splitlines()
        print(f"--- last {min(lines, len(have))} of {len(have)} lines of "
              f"{self.state_dir}/daemon.log")
        print("\n".join(have[-lines:]))

    def teardown(self, down_timeout: float = 120) -> None:
        """End whatever this state dir's dynamod started, and remove the dir: `down` if its
        daemon is up, then SIGKILL any process still carrying this run's marker (only ours,
        never by name), whether or not `down` finished in time."""
        run_id = self.run_id()
        try:
            if (self.state_dir / "dynamod.sock").exists():
                self.run("down", timeout=down_timeout)
        finally:
            for pid in marked_pids(run_id) if run_id else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.state_dir, ignore_errors=True)


# `make test` builds the extra venvs beside the suite and names where it says each is made
# (Makefile, VENVS_MADE): a file NAME when it is, NAME.failed when its install failed.
_VENVS_MADE = "DYNAMOD_TEST_VENVS_MADE"
VENV_WAIT_S = 900.0


def extra_venv(folder: str, name: str) -> Path:
    """ROOT/folder, an extra venv (.venv-vllm: name vllm; .venv-aiperf: name aiperf). Under
    `make test` it may still be being made when a test wants it: wait until make says it
    is (or failed, or VENV_WAIT_S passed). Elsewhere it is used as it is."""
    made = os.environ.get(_VENVS_MADE)
    if made:
        deadline = time.monotonic() + VENV_WAIT_S
        while not (Path(made) / name).exists():
            if (Path(made) / f"{name}.failed").exists():
                pytest.fail(f"make test could not make {folder} (its install's output is above)")
            if time.monotonic() > deadline:
                pytest.fail(f"{folder} was not made within {VENV_WAIT_S:g} s of waiting for it")
            time.sleep(1.0)
    return ROOT / folder


def unit_by_name(status: dict[str, Any], name: str) -> UnitStatus:
    units: list[UnitStatus] = status["units"]
    return next(u for u in units if u["name"] == name)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


@pytest.fixture
def dm(request: pytest.FixtureRequest) -> Iterator[Dynamod]:
    state = Path(tempfile.mkdtemp(prefix="dm-", dir="/tmp"))
    d = Dynamod(state)
    yield d
    if _failed(request):  # the state dir goes below: say what the daemon saw (CI keeps this)
        d.print_log_tail(80)
    d.teardown()


@pytest.fixture
def stack_file(tmp_path: Path) -> Any:
    def write(text: str, name: str = "stack.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).replace("@PROC@", str(PROC)))
        return path

    return write
