"""Ray as units across nodes: the stock units/cluster/ray-head.toml and units/ray-worker.toml
commands (rendered here for two network namespaces) start a head on one node and a worker on
the other, and the worker joins: the head's GCS counts two alive nodes. Needs `ray` (the
verl extra) beside the interpreter."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamod.chaos.netns import Sandbox, can_create_namespaces
from tests.integration.verl_rig import BIN, start_ray

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("netns")]
REASON = can_create_namespaces()
if REASON is not None:
    pytest.skip(f"no network namespaces: {REASON}", allow_module_level=True)
if not (BIN / "ray").exists():
    pytest.skip(f"ray is not installed beside {sys.executable} (the verl extra)",
                allow_module_level=True)  # fmt: skip


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Ray's socket paths under its temp dir must fit AF_UNIX's 107 bytes: not tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="dr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_ray_worker_joins_the_head_across_nodes(short_dir: Path) -> None:
    with Sandbox(2, prefix="dmray") as box:
        procs = start_ray(box, short_dir)  # raises unless the head counts two alive nodes
        assert all(proc.poll() is None for proc in procs)
