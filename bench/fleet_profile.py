"""Where a daemon's and a shard's CPU go during the push (`bench.fleet --profile DIR`):
py-spy samples the head's daemon and the last node's, and the head's first shard and the
last node's last, through the trainer's stall, and each sample is counted under what the
process's event loop was running (the task or callback below asyncio's `Handle._run`: a
shard's probe, the registry's publish, the policy's apply; under uvloop, the shards' loop,
the task's outermost frame below `Runner.run`, past the routes' thin wrappers), or the
thread it ran in outside the loop. The daemons' and the shards' CPU in the push grow faster
than linear with the node count (bench.fleet's growth table); these tables say which of
their parts do.

The samples' files (py-spy's raw format, one stack a line, then its count) stay in DIR, so
any other cut of them can be made later."""

from __future__ import annotations

import contextlib
import math
import re
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import procs
from bench.procs import BIN
from bench.report import Table
from dynamod.core.errors import DynamodError

PY_SPY = BIN / "py-spy"
RATE = 100  # samples a second; what py-spy cost is read back (py_spy_cpu_s)
ATTACH_S = 1.0  # py-spy's attach; the push starts after it
LOOP_RUN = "Handle._run (asyncio/events.py"
# uvloop (the shards' loop) runs a task's step from C: its outermost frame is right below
# the runner's
RUNNER = "Runner.run (asyncio/runners.py"
# a shard's engine routes reach their handler through these (workers/cpu/routes.py
# `catching`, admission.py `serialised`): the handler below them is the task
WRAPPERS = (
    "catching.<locals>.answer (workers/cpu/routes.py)",
    "CpuWorker.serialised.<locals>.locked (workers/cpu/admission.py)",
)
# a sample in one of these is the thread waiting, not running (py-spy's own idle check
# misses a loop in select with the GIL released now and then)
WAITING = re.compile(r"^(\S+\.)?(select|poll|wait|_wait_for_tstate_lock|accept|sleep) \(")
ROOTS = ("Thread._bootstrap", "_run_module_as_main", "<module>")  # a whole stack starts so
FRAME = re.compile(r"^(?P<fn>\S+) \((?P<file>[^:)]+)(?::\d+)?\)$")


class ProfileError(DynamodError):
    """py-spy could not sample a process: the push is not measured with a profile."""


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
    log: Path
    proc: subprocess.Popen[bytes]

    def cpu_s(self) -> float:
        """py-spy's own CPU so far: what the profile cost the machine."""
        with contextlib.suppress(OSError):
            return procs.cpu_seconds(self.proc.pid)
        return math.nan


def start(targets: dict[str, int], out_dir: Path, label: str) -> list[Profiler]:
    """py-spy on each of `targets` (a daemon's node, or NODE/SHARD for a shard -> pid), its
    samples to OUT_DIR/LABEL-NAME.txt, what it says to LABEL-NAME.log (NAME: the target's,
    its / and @ as -). None left running if one fails to attach."""
    out_dir.mkdir(parents=True, exist_ok=True)
    profilers: list[Profiler] = []
    for node, pid in targets.items():
        name = re.sub(r"[/@]", "-", node)
        out, log = out_dir / f"{label}-{name}.txt", out_dir / f"{label}-{name}.log"
        command = [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(RATE),
                   "--format", "raw", "--nonblocking", "--output", str(out)]  # fmt: skip
        with log.open("wb") as said:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=said)  # fmt: skip
        profilers.append(Profiler(node, pid, out, log, proc))
    time.sleep(ATTACH_S)
    for p in profilers:
        if p.proc.poll() is not None:
            for q in profilers:  # ours, by pid
                if q.proc.poll() is None:
                    q.proc.kill()
                    q.proc.wait(10)
            raise ProfileError(f"py-spy on {what(p.node)} (pid {p.pid}) exited: see {p.log}")
    return profilers


def stop(profilers: list[Profiler]) -> dict[str, dict[str, Any]]:
    """Stop each py-spy (SIGINT: it writes its samples), then count them by task."""
    cost = {p.node: p.cpu_s() for p in profilers}
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
            raise ProfileError(f"py-spy on {what(p.node)} wrote no samples: see {p.log}")
        busy, tasks = by_task(p.out.read_text())
        found[p.node] = {"rate": RATE, "samples": busy, "by_task": dict(tasks),
                         "file": str(p.out), "py_spy_cpu_s": cost[p.node]}  # fmt: skip
    return found


def what(target: str) -> str:
    """`n1` -> "n1's daemon"; `n1/worker@0` -> "n1's shard worker@0"."""
    node, _, shard = target.partition("/")
    return f"{node}'s shard {shard}" if shard else f"{node}'s daemon"


def short(frame: str) -> str:
    """`Membership._publish (dynamod/cluster/membership.py:470)` -> `Membership._publish
    (cluster/membership.py)`: no line, the package's own prefix dropped."""
    m = FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    path = re.sub(r"^.*?(site-packages/|dynamod/)", "", m["file"])
    return f"{m['fn']} ({path})"


def task_of(frames: list[str]) -> str:
    """What the daemon ran in this sample: in the event loop, the frame below its last
    `Handle._run` (the task or callback), or "the event loop itself" (its own bookkeeping);
    in the default executor, the function handed to it; in another thread, the thread's
    target. A stack that starts at no thread's root (py-spy reads it without pausing the
    process, and now and then catches it mid-change) is counted under its outermost frame."""
    runs = [i for i, f in enumerate(frames) if f.startswith(LOOP_RUN)]
    if runs:
        below = frames[runs[-1] + 1 : runs[-1] + 2]
        return short(below[0]) if below else "the event loop itself"
    if any(f.startswith("BaseEventLoop._run_once") for f in frames):
        return "the event loop itself"
    runner = [i for i, f in enumerate(frames) if f.startswith(RUNNER)]
    if runner:  # uvloop: the task's frames right below the runner's
        below = [short(f) for f in frames[runner[-1] + 1 :]]
        while len(below) > 1 and below[0] in WRAPPERS:
            below = below[1:]
        return below[0] if below else "the event loop itself"
    if not frames[0].startswith(ROOTS):
        return short(frames[0])
    work = [i for i, f in enumerate(frames) if f.startswith("_WorkItem.run")]
    if work and work[-1] + 1 < len(frames):
        return "executor: " + short(frames[work[-1] + 1])
    if frames[0].startswith("Thread."):
        target = [f for f in frames if not f.startswith("Thread.")]
        return "thread: " + (short(target[0]) if target else "a native target (Thread.run)")
    return "main thread: " + short(frames[-1])


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
    """Each profiled process's CPU in the push by task, its largest first: the task's share
    of the process's busy samples, and that share of its CPU in the push as /proc counted
    it (`cpu_s`); a daemon's also a shard of its node's, a shard's is its own. A sample
    says what ran or was ready to run; on a machine busier than its cores the share holds
    while samples over the rate would not."""
    table = Table(
        "The daemons' and two shards' CPU in the push by what they ran (py-spy, --profile): "
        f"the {top} largest of each; CPU ms = its share of the samples x the process's CPU",
        ["nodes", "shards", "process", "task", "busy samples", "share %", "CPU ms",
         "CPU ms a shard (a daemon's: of its node's)", "py-spy's own CPU ms"],
        digits=1,
    )  # fmt: skip
    for f in fleets:
        per_node = f["shards"] / f["nodes"]
        for node, p in (f.get("push", {}).get("profile") or {}).items():
            cpu_ms = 1000 * p["cpu_s"] if p.get("cpu_s") is not None else math.nan
            per = 1 if "/" in node else per_node
            ranked = sorted(p["by_task"].items(), key=lambda kv: -kv[1])
            for task, n in [("all", p["samples"]), *ranked[:top]]:
                share = n / p["samples"] if p["samples"] else math.nan
                cost = 1000 * p.get("py_spy_cpu_s", math.nan) if task == "all" else "-"
                table.rows.append(
                    [f["nodes"], f["shards"], what(node), task, n, 100 * share,
                     share * cpu_ms, share * cpu_ms / per, cost]
                )  # fmt: skip
    return table
