"""`make test` runs `-n 2 --dist loadgroup` and relies on each module's tests staying on one
worker (tests/xdist_groups.py groups them), so that a module-scoped stack starts once and
its tests run in order against it. pytest 9.2 with xdist 3.8 dropped the groups without a
word (pytest-dev/pytest-xdist#1386): this runs a small suite the same way and fails if a
module with a module-scoped fixture had its tests spread over the workers, or if a test
that shares nothing was grouped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

MODULE = """
import os
from pathlib import Path

import pytest

@pytest.fixture(scope="module")
def stack():
    return "started once"

@pytest.mark.parametrize("i", range(6))
def test_where(i, stack):
    ran = Path(__file__).parent / "ran"
    (ran / f"{__name__}.{i}.{os.environ['PYTEST_XDIST_WORKER']}").touch()
"""

# A module whose tests share nothing: each goes where xdist has room, in no group.
FREE = """
import os
from pathlib import Path

def test_alone(request):
    ran = Path(__file__).parent / "ran"
    grouped = "grouped" if "@" in request.node.nodeid else "free"
    (ran / f"{__name__}.{grouped}.{os.environ['PYTEST_XDIST_WORKER']}").touch()
"""


def test_a_shared_stacks_tests_stay_on_one_worker_the_others_go_free(tmp_path: Path) -> None:
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(MODULE)
    (tmp_path / "test_free.py").write_text(FREE)
    (tmp_path / "ran").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist.plugin",
         "-p", "tests.xdist_groups", "-n", "2", "--dist", "loadgroup",
         "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for mark in (tmp_path / "ran").iterdir():
        module, _, worker = mark.name.split(".")
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == {"test_one", "test_two", "test_free"}, result.stdout[-2000:]
    assert list((tmp_path / "ran").glob("test_free.free.*")), "a test sharing nothing was grouped"
    del workers["test_free"]
    spread = {m: sorted(w) for m, w in workers.items() if len(w) > 1}
    assert not spread, f"a module's tests ran on several workers: {spread}"
