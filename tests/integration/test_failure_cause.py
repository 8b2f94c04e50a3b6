"""A unit that keeps failing at start names its own cause (dynamod/core/causes.py): the
exception its process raised, read from its log, in `status` while it is retried, in
`up`'s failure message, and in last-down.json once the stack is down. A plain Python
process stands in for an engine here (seconds); tests/integration/test_real_engine.py does
the same with a real dynamo.vllm shard refusing a flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import Dynamod, unit_by_name

CAUSE = "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
ENGINE = f"""
import sys, time
print("loading the model", flush=True)
time.sleep(0.3)
print("Traceback (most recent call last):", file=sys.stderr)
print("{CAUSE}", file=sys.stderr)
print("RuntimeError: Engine core initialization failed. See root cause above.", file=sys.stderr)
sys.exit(1)
"""


def test_status_and_up_name_a_failing_units_own_cause(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE)
    stack = stack_file(f"""
        [stack]
        name = "cause"
        [units.engine]
        command = ["{sys.executable}", "{engine}"]
        restart = {{ policy = "always", backoff_initial = 1, limit_burst = 3, limit_interval = 60 }}
    """)
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir)]
    up = subprocess.Popen(
        [*cmd, "up", str(stack), "--detach", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        retried = dm.wait_for(
            lambda s: (u := unit_by_name(s, "engine"))["cause"] and u, timeout=60,
            what="the retried unit's cause in status",
        )  # fmt: skip
        assert retried["cause"] == CAUSE, retried
        shown = subprocess.run([*cmd, "status"], capture_output=True, text=True, timeout=60)
        assert f"cause: {CAUSE}" in shown.stdout, shown  # retries go on for ~7 s
    finally:
        code = up.wait(timeout=120)
    err = up.communicate()[1]
    assert code == 1 and f"its own cause: {CAUSE}" in err, err
    rows = json.loads((dm.state_dir / "last-down.json").read_text())["units"]
    assert unit_by_name({"units": rows}, "engine")["cause"] == CAUSE, rows


ONCE = f"""
import pathlib, sys, time
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.touch()
    print("{CAUSE}", file=sys.stderr, flush=True)
    sys.exit(1)
print("trying again: up, never ready", flush=True)
time.sleep(600)
"""


def test_up_timing_out_on_a_retry_names_the_failed_attempts_cause(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    """`up` gives up while the unit's next attempt is starting (not in backoff): the
    failed attempt's cause is still what it shows, not only the new attempt's probe."""
    engine = tmp_path / "engine.py"
    engine.write_text(ONCE)
    stack = stack_file(f"""
        [stack]
        name = "retrying"
        [units.engine]
        command = ["{sys.executable}", "{engine}", "{tmp_path / "failed-once"}"]
        ports = {{ http = 0 }}
        restart = {{ policy = "always", backoff_initial = 0.2 }}
        [units.engine.ready]
        kind = "http"
        url = "http://127.0.0.1:{{ports.http}}/health"
        deadline = 120
    """)
    up = dm.run("up", str(stack), "--detach", "--timeout", "8")
    assert up.returncode == 1, up.stdout + up.stderr
    shown = up.stderr.split("not ready after 8s")[1]
    assert "engine: starting:" in shown, up.stderr  # the second attempt, running
    assert f"its own cause: {CAUSE}" in shown, up.stderr
