"""The CPU worker's discovery directories: a worker killed by SIGKILL leaves its own behind;
the next worker to start removes those whose process is gone, and only those."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from dynamod.workers.cpu import discovery


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_gone_workers_directory_is_swept_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    gone = tmp_path / f"{discovery.PREFIX}{_dead_pid()}-abc"
    live = tmp_path / f"{discovery.PREFIX}{os.getpid()}-def"
    unnamed = tmp_path / f"{discovery.PREFIX}xyz"  # no pid in the name: not ours to judge
    other = tmp_path / "something-else-1-2"
    for path in (gone, live, unnamed, other):
        path.mkdir()
    (gone / "file.json").write_text("{}")
    assert discovery.sweep(tmp_path) == [gone]
    assert not gone.exists() and live.is_dir() and unnamed.is_dir() and other.is_dir()


def test_a_workers_directory_names_its_pid_and_goes_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with discovery.directory() as made:
        assert Path(made).name.startswith(f"{discovery.PREFIX}{os.getpid()}-")
        assert discovery.sweep(tmp_path) == []  # its own process is alive
    assert not Path(made).exists()
