"""`dynamod systemd generate/install`: the files pass `systemd-analyze verify`, and their
Exec lines do what systemd would have them do (no systemd manager runs in the test)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Dynamod, wait_dead

pytestmark = pytest.mark.slow

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def verify(unit: Path) -> str:
    """`systemd-analyze verify` output (warnings included); fails on a non-zero exit."""
    assert ANALYZE is not None
    result = subprocess.run(
        [ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60,
        cwd=unit.parent,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"systemd-analyze verify {unit.name}:\n{output}"
    return output


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def words(line: str) -> list[str]:
    """An Exec line split the way systemd does, for lines without specifiers or variables
    (there systemd's double-quote and backslash rules agree with POSIX shell's)."""
    assert "%" not in line and "$" not in line, line
    return shlex.split(line)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "units"


@needs_analyze
def test_systemd_analyze_verify_really_checks_here(tmp_path: Path) -> None:
    """The control: a broken unit is reported, so a quiet verify below means something."""
    bad = tmp_path / "broken.service"
    bad.write_text("[Service]\nExecStart=/nonexistent/dynamod up\nKillMode=sideways\n")
    result = subprocess.run([str(ANALYZE), "verify", str(bad)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "kill mode" in output and "/nonexistent/dynamod" in output


@needs_analyze
def test_stack_service_verifies_and_runs_the_stack_as_notify_service(
    dm: Dynamod, out: Path
) -> None:
    dm.run("systemd", "generate", "infra", "--out", str(out), check=True)
    template = out / "dynamod@.service"
    assert verify(template) == ""
    assert verify(out / "dynamod@infra.service") == ""  # the instance, %i expanded
    found = settings(template.read_text())
    assert found["Type"] == ["notify"] and found["KillMode"] == ["mixed"]

    # Run ExecStart/ExecStop as systemd would, with the state dir outside /run.
    state = Path(tempfile.mkdtemp(prefix="dm-sd-", dir="/tmp"))
    start = words(found["ExecStart"][0].replace("/run/dynamod/%i", str(state)))
    stop = words(found["ExecStop"][0].replace("/run/dynamod/%i", str(state)))
    assert start[-2:] == ["up", str(Path("units/stacks/infra.toml").resolve())]
    notify_path = state.parent / f"{state.name}.notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(30)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
        main = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while b"READY=1" not in notify.recv(4096):
                pass
            status = Dynamod(state).status()
            assert status["phase"] == "up"
            pids = [u["pid"] for u in status["units"]]
            # reap the main process while ExecStop runs, as systemd would (`down` waits
            # for the daemon's pid to go away, and a zombie child never does)
            stopper = subprocess.Popen(stop, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert main.wait(timeout=30) == 0
            assert stopper.wait(timeout=30) == 0
            assert stopper.stdout is not None
            assert b"nothing left running" in stopper.stdout.read()
        finally:
            if main.poll() is None:
                os.killpg(main.pid, signal.SIGKILL)
                main.wait(timeout=10)
            notify_path.unlink(missing_ok=True)
            shutil.rmtree(state, ignore_errors=True)
    assert wait_dead(pids, timeout=5) == []


@needs_analyze
def test_per_unit_services_verify_with_dependencies(
    dm: Dynamod, stack_file: object, out: Path
) -> None:
    path = stack_file(  # type: ignore[operator]
        """
        [units.db]
        description = "a database, 100% made up"
        command = ["{python}", "@PROC@", "serve", "{ports.http}", "--name", "a \\"b\\" $c"]
        ports = { http = 0 }
        env = { MODE = "fast; safe", PCT = "50%" }
        stop = { signal = "SIGINT", timeout = 7 }
        ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/", deadline = 20 }
        live = { kind = "tcp", port = "{ports.http}" }

        [units.setup]
        type = "oneshot"
        command = ["{python}", "@PROC@", "exit", "0"]
        restart = { policy = "on-failure" }

        [units.worker]
        replicas = 2
        command = ["{python}", "@PROC@", "sleep"]
        depends_on = { db = "ready", setup = "completed" }
        restart = { policy = "always" }
        """
    )
    result = dm.run("systemd", "generate", str(path), "--per-unit", "--out", str(out), check=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["dynamod-db.service", "dynamod-setup.service", "dynamod-stack.target",
                     "dynamod-worker@0.service", "dynamod-worker@1.service"]
    for name in names:
        assert verify(out / name) == "", name
    assert "liveness probes are not run (a hung db is not restarted)" in result.stderr

    worker = settings((out / "dynamod-worker@1.service").read_text())
    assert worker["Requires"] == worker["After"] == ["dynamod-db.service dynamod-setup.service"]
    assert worker["Restart"] == ["always"] and worker["KillMode"] == ["control-group"]
    setup = settings((out / "dynamod-setup.service").read_text())
    assert setup["Type"] == ["oneshot"] and setup["RemainAfterExit"] == ["yes"]
    db = settings((out / "dynamod-db.service").read_text())
    assert db["KillSignal"] == ["SIGINT"] and db["TimeoutStopSec"] == ["7"]
    assert 'Environment="PCT=50%%"' in (out / "dynamod-db.service").read_text()
    assert "$$c" in db["ExecStart"][0]

    installed = tmp_dir = out.parent / "etc"
    result = dm.run("systemd", "install", str(path), "--per-unit", "--dir", str(tmp_dir),
                    check=True)
    assert sorted(p.name for p in installed.iterdir()) == names
    assert "systemctl daemon-reload" in result.stdout
    assert "systemctl enable --now dynamod-stack.target" in result.stdout


@pytest.fixture
def groups() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def test_per_unit_exec_lines_start_infra_and_wait_for_readiness(
    dm: Dynamod, out: Path, groups: list[subprocess.Popen[bytes]]
) -> None:
    """ExecStart starts etcd/NATS; ExecStartPost (`dynamod systemd wait-ready`) returns
    only once each answers its health check."""
    dm.run("systemd", "generate", "infra", "--per-unit", "--out", str(out), check=True)
    for unit in ("etcd", "nats"):
        found = settings((out / f"dynamod-{unit}.service").read_text())
        env = dict(os.environ)
        for assignment in found["Environment"]:
            key, _, value = words(assignment)[0].partition("=")
            env[key] = value
        assert env["PATH"].startswith(f"{Path(sys.executable).parent}:")
        began = time.monotonic()
        groups.append(subprocess.Popen(words(found["ExecStart"][0]), env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                       start_new_session=True))
        post = subprocess.run(words(found["ExecStartPost"][0]), env=env, capture_output=True,
                              text=True, timeout=60)
        assert post.returncode == 0, post.stderr
        assert post.stdout.startswith("ready: GET http://127.0.0.1:")
        assert time.monotonic() - began < 20
        url = post.stdout.split()[2].rstrip(":")
        with urllib.request.urlopen(url, timeout=2) as resp:
            assert resp.status == 200

    # and a probe that cannot pass fails the ExecStartPost (the start fails, Restart= acts)
    post = subprocess.run(
        [sys.executable, "-m", "dynamod", "systemd", "wait-ready",
         '{"kind": "tcp", "port": 1, "deadline": 0.5}'],
        capture_output=True, text=True, timeout=30,
    )
    assert post.returncode == 1 and "not ready within 0.5s: tcp 127.0.0.1:1" in post.stderr
