"""bench.procs.bench_mark: what a benchmark starts writes its temporary files into a
directory of the run's own (the benchmark's own temporary files too), removed when the
benchmark exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SCRIPT = """
import json, subprocess, sys, tempfile
from bench.procs import bench_mark
bench_mark()
child = subprocess.run([sys.executable, "-c", "import tempfile; f = tempfile.NamedTemporaryFile("
                        "suffix='.json', delete=False); print(f.name)"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"own": tempfile.gettempdir(), "child_file": child}))
"""


def test_children_write_into_the_runs_own_tmpdir_and_it_goes_at_exit() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    child_file = Path(seen["child_file"])
    assert seen["own"] == str(child_file.parent), seen
    assert child_file.parent.parent == Path("/tmp"), child_file
    assert child_file.parent.name.startswith("bench-tmp-"), child_file
    assert not child_file.parent.exists()  # removed with what the child left in it
