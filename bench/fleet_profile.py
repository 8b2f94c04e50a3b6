"""Where a daemon's CPU goes during the push (`bench.fleet --profile DIR`): py-spy samples
the head's daemon and the last node's through the trainer's stall, and each sample is
counted under what the daemon's event loop was running (the task or callback below the
loop's `Handle._run`: a shard's probe, the registry's publish, the policy's apply), or the
thread it ran in outside the loop. The daemons' CPU in the push grows faster than linear
with the node count (bench.fleet's growth table); these tables say which of its parts do.

The samples' files (py-spy's raw format, one stack a line, then its count) stay in DIR, so
any other cut of them can be made later."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import BIN
from bench.report import Table
from dynamod.core.errors import DynamodError

PY_SPY = BIN / "py-spy"
RATE = 100  # samples a second: 2 py-spy processes at 100 Hz cost the push little
ATTACH_S = 1.0  # py-spy's attach; the push starts after it
LOOP_RUN = "Handle._run (asyncio/events.py"
# a sample in one of these is the thread waiting, not running (py-spy's own idle check
# misses a loop in select with the GIL released now and then)
WAITING = re.compile(r"^(\S+\.)?(select|poll|wait|_wait_for_tstate_lock|accept|sleep) \(")
FRAME = re.compile(r"^(?P<fn>\S+) \((?P<file>[^:)]+)(?::\d+)?\)$")


class ProfileError(DynamodError):
    """py-spy could not sample a daemon: the push is not measured with a profile."""


def missing() -> str | None:
    """Why --profile cannot run here, or None."""
    if not PY_SPY.exists():
        return f"--profile needs py-spy ({PY_SPY} is missing: `make install` brings it)"
    return None


@dataclass
class Profiler:
    node: str
    pid: int
    out: Path
    proc: subprocess.Popen[bytes]


def start(daemons: dict[str, int], out_dir: Path, label: str) -> list[Profiler]:
    """py-spy on each of `daemons` (node -> pid), its samples to OUT_DIR/LABEL-NODE.txt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    profilers = []
    for node, pid in daemons.items():
        out = out_dir / f"{label}-{node}.txt"
        command = [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(RATE),
                   "--format", "raw", "--nonblocking", "--output", str(out)]  # fmt: skip
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=(out_dir / f"{label}-{node}.log").open("wb"),
        )  # fmt: skip
        profilers.append(Profiler(node, pid, out, proc))
    time.sleep(ATTACH_S)
    for p in profilers:
        if p.proc.poll() is not None:
            raise ProfileError(f"py-spy on {p.node}'s daemon (pid {p.pid}) exited: see {p.out}.log")
    return profilers


def stop(profilers: list[Profiler]) -> dict[str, dict[str, Any]]:
    """Stop each py-spy (SIGINT: it writes its samples), then count them by task."""
    for p in profilers:
        p.proc.send_signal(signal.SIGINT)
    found: dict[str, dict[str, Any]] = {}
    for p in profilers:
        try:
            p.proc.wait(60)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(10)
        if not p.out.exists():
            raise ProfileError(f"py-spy on {p.node}'s daemon wrote no samples: see {p.out}.log")
        busy, tasks = by_task(p.out.read_text())
        found[p.node] = {"rate": RATE, "samples": busy, "by_task": dict(tasks), "file": str(p.out)}
    return found


def short(frame: str) -> str:
    """`Membership._publish (dynamod/cluster/membership.py:470)` -> `Membership._publish
    (cluster/membership.py)`: no line, the package's own prefix dropped."""
    m = FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    path = re.sub(r"^.*?(site-packages/|dynamod/)", "", m["file"])
    return f"{m['fn']} ({path})"


def task_of(frames: list[str]) -> str:
    """What the loop was running in this sample: the frame below its last `Handle._run`;
    outside the loop, the thread's outermost frame past threading's own."""
    runs = [i for i, f in enumerate(frames) if f.startswith(LOOP_RUN)]
    if runs and runs[-1] + 1 < len(frames):
        return short(frames[runs[-1] + 1])
    if runs:
        return "the event loop itself"
    rest = [f for f in frames if not f.startswith(("Thread.", "<module>", "_run_module"))]
    if rest and rest[0].startswith("BaseEventLoop."):
        return "the event loop itself"
    return "thread: " + short(rest[0]) if rest else "thread: (threading)"


def by_task(raw: str) -> tuple[int, Counter[str]]:
    """py-spy raw text -> (busy samples, busy samples by task); waiting samples left out."""
    tasks: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if WAITING.match(frames[-1]):
            continue
        tasks[task_of(frames)] += int(count)
    return sum(tasks.values()), tasks


def profile_table(fleets: list[dict[str, Any]], top: int = 8) -> Table:
    """Each profiled daemon's CPU in the push by task, its largest first, ms of CPU and
    ms a shard of its node (the shards it supervises)."""
    table = Table(
        "The daemons' CPU in the push by what their event loop ran (py-spy, --profile): "
        f"the {top} largest of each",
        ["nodes", "shards", "daemon", "task", "CPU ms", "ms a shard of its node", "share %"],
        digits=1,
    )  # fmt: skip
    for f in fleets:
        per_node = f["shards"] / f["nodes"]
        for node, p in (f.get("push", {}).get("profile") or {}).items():
            tick_ms = 1000 / p["rate"]
            ranked = sorted(p["by_task"].items(), key=lambda kv: -kv[1])
            for task, n in [("all", p["samples"]), *ranked[:top]]:
                table.rows.append(
                    [f["nodes"], f["shards"], node, task, n * tick_ms, n * tick_ms / per_node,
                     100 * n / p["samples"] if p["samples"] else 0.0]
                )  # fmt: skip
    return table
