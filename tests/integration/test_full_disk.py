"""A full disk never stops supervision (issue 16 §1): the state dir on a 2 MB tmpfs.

Needs root to mount; skips with the reason where mounting fails. Always unmounts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.core.atomicfile import StateWriteError, write_atomic
from dynamod.core.proctable import marked_pids
from dynamod.rollout.ledger import FileLedger, PolicyVersion
from tests.conftest import ROOT, Dynamod, pid_alive, unit_by_name, wait_dead

pytestmark = pytest.mark.slow


@pytest.fixture
def small_dm() -> Iterator[Dynamod]:
    path = Path(tempfile.mkdtemp(prefix="dmfull-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a 2 MB tmpfs at {path} (needs root): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    dm = Dynamod(path)
    try:
        yield dm
    finally:
        run_id = dm.run_id()
        with contextlib.suppress(OSError):
            (path / "filler").unlink()
        if (path / "dynamod.sock").exists():
            dm.run("down", timeout=120)
        if run_id:
            for pid in marked_pids(run_id):
                os.kill(pid, signal.SIGKILL)
        umount = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if umount.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def fill(directory: Path) -> None:
    """Write `filler` until the filesystem takes no more."""
    with open(directory / "filler", "ab", buffering=0) as fh:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    fh.write(b"f" * size)
    probe = directory / ".probe"
    with pytest.raises(OSError), open(probe, "wb", buffering=0) as fh:
        fh.write(b"x" * 4096)
    probe.unlink(missing_ok=True)


def _until_dropping_stops(dm: Dynamod, unit: str, timeout: float = 30.0) -> None:
    """Until the unit's dropped-byte count has not moved for 0.5 s: it writes nothing more
    (a wait on `log_dropped_bytes > 0` held already, and the flood's tail then landed after
    the space came back, between the marker and the next header)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        dropped = unit_by_name(dm.status(), unit)["log_dropped_bytes"]
        if dropped != last:
            last, since = dropped, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return
        time.sleep(0.1)
    raise AssertionError(f"{unit} kept writing for {timeout:g}s after it was told to stop")


def test_a_full_disk_never_stops_supervision(
    small_dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    dm = small_dm
    flag = tmp_path / "noisy-on"  # on the ordinary disk, not the tmpfs
    flag.touch()
    stack = stack_file(f"""
        [units.svc]
        command = ["{{python}}", "@PROC@", "serve", "{{ports.http}}"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
        [units.noisy]
        command = ["{{python}}", "@PROC@", "noisy", "{flag}"]
    """)
    dm.run("up", str(stack), "--detach", check=True)
    fill(dm.state_dir)

    status = dm.wait_for(lambda s: s.get("logs", {}).get("reason") == "disk full" and s,
                         what="dropped output counted")
    assert unit_by_name(status, "noisy")["log_dropped_bytes"] > 0
    assert "dropped, disk full" in dm.run("status", check=True).stdout

    svc = unit_by_name(status, "svc")
    os.kill(svc["pid"], signal.SIGKILL)  # killed while the disk is full: still restarted
    again = dm.wait_ready_again("svc", svc["pid"])
    assert again["restarts"] == 1

    flag.unlink()  # noisy goes quiet while the disk is still full (its last lines dropped) ...
    _until_dropping_stops(dm, "noisy")
    (dm.state_dir / "filler").unlink()  # ... and space returns
    dm.run("restart", "noisy", check=True)  # its next header is written: logging resumed
    status = dm.wait_for(lambda s: unit_by_name(s, "noisy")["log_drop_reason"] is None and s,
                         what="noisy writing again")
    text = (dm.state_dir / "logs" / "noisy.log").read_text()
    # The marker counts what was dropped; then writing resumes with the next spawn's header.
    assert "bytes of output dropped (disk full)\n--- dynamod: start #2 pid " in text, text[-400:]
    assert status["logs"]["reason"] == "earlier; writing again"
    records = [json.loads(line) for line in dm.daemon_log().splitlines() if line.strip()]
    assert any(r["event"] == "unit.state" and r.get("unit") == "noisy"
               and r.get("new") == "stopping" for r in records)  # the daemon's log resumed

    fill(dm.state_dir)  # `down` on a full disk completes and says what it could not keep
    daemon_pid = status["daemon_pid"]
    down = dm.run("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "nothing left running" in down.stdout
    assert "last-down.json: disk full; the previous version is kept" in down.stderr
    assert wait_dead([daemon_pid]) == [] and not pid_alive(daemon_pid)
    run_id = dm.run_id()
    assert run_id and wait_dead(marked_pids(run_id)) == []


def test_etcd_without_space_fails_showing_the_enospc_line(
    small_dm: Dynamod, tmp_path: Path
) -> None:
    stack = tmp_path / "etcd-only.toml"
    stack.write_text(f'[stack]\ninclude = ["{ROOT / "units" / "etcd.toml"}"]\n')
    # etcd is infrastructure: it is retried forever (issue 15), so `up` ends at its timeout
    # and says why etcd keeps failing (it fails in ~0.1 s; an `up` that ended while etcd's
    # next attempt was starting used to show only that attempt's probe).
    result = small_dm.run("up", str(stack), "--detach", "--timeout", "15")
    assert result.returncode == 1, result.stdout + result.stderr
    err = result.stderr
    assert "earlier lines that say what went wrong:" in err, err
    cause = err.split("earlier lines that say what went wrong:")[1].split("last lines:")[0]
    assert "no space left on device" in cause
    assert "main.main()" in err.split("last lines:")[1]  # the stack trace still follows


def test_state_that_must_survive_keeps_its_old_version_on_a_full_disk(
    small_dm: Dynamod,
) -> None:
    state = small_dm.state_dir
    run = state / "run.json"
    write_atomic(run, b'{"v": 1}')
    ledger = FileLedger(state / "ledger.json")
    first = PolicyVersion(1, "/ckpt/1", "d1", 0.0, "push")
    asyncio.run(ledger.advance(first, keep=3))
    fill(state)

    with pytest.raises(StateWriteError) as info:
        write_atomic(run, b'{"v": 2}' * 1000)
    assert str(info.value) == f"cannot write {run}: disk full; the previous version is kept"
    assert run.read_bytes() == b'{"v": 1}'

    second = PolicyVersion(2, "/ckpt/2", "d2", 0.0, "push")
    with pytest.raises(StateWriteError, match=r"ledger\.json: disk full"):
        asyncio.run(ledger.advance(second, keep=3))
    assert asyncio.run(ledger.current()) == first
    assert sorted(p.name for p in state.iterdir()) == ["filler", "ledger.json", "run.json"]
