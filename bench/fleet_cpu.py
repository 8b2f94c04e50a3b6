"""Where the machine's cores went in a short window (an early push's stall): every process
on the machine read from /proc/<pid>/stat before and after, and its CPU in the window put
to the fleet's part it belongs to: the shard the answer waited on, the head's other
shards, the head's daemon and its other units by name (etcd, its relay, NATS, the
frontend), the other nodes' shards, daemons and units (on a fleet of machines, not on the
head's cores), the benchmark itself (its load's threads and its call to the daemon), and
what is none of these by its command's name (the kernel's threads among them). Beside it,
the answer's shard's and the head's daemon's threads' own run time and wait for a core
(their schedstat, fleet_threads.Waits), and the machine's busy time over the same window;
with the scheduler's trace (fleet_sched), behind whom they waited.

A process that is not a fleet's unit belongs to its nearest ancestor that is (a daemon's
probe, a unit's own child). /proc counts a process's CPU in clock ticks (10 ms): over a
window of a few ticks a part's share is a sample, and the parts add up to the machine's
busy time only roughly (interrupts are the machine's, not a process's)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import host
from bench.fleet_sched import OWN, Event, SchedTrace, Schedule, own, parse
from bench.fleet_threads import Waits, group
from bench.host import PROC
from bench.procs import Reread, parse_stat
from bench.report import Table
from dynamod.chaos.cluster import ClusterRig

FIRST = "first shard"
HEAD_SHARDS = "head's other shards"
HEAD_DAEMON = "head's daemon"
SHARDS = "other nodes' shards"
DAEMONS = "other nodes' daemons"
ELSEWHERE = "other nodes' "  # before a unit's name: that unit on the other nodes
BENCH = "bench (load, the call)"
# the columns before the rest's: the head's shards and daemon, then the other nodes' (on a
# fleet of machines, not on the head's cores)
PARTS = (FIRST, HEAD_SHARDS, HEAD_DAEMON, SHARDS, DAEMONS)
REST = 6  # the other parts shown in a row, the largest first
AHEAD_NICE = -10  # the reads around a stall, ahead of the fleet's nice 0 (`ahead`)


def pids_of(units: list[dict[str, Any]], *, shards: bool) -> dict[str, int]:
    """The running units of a node's status rows: its shards, or the rest (etcd, its
    relay, NATS, the frontend)."""
    return {u["name"]: int(u["pid"]) for u in units
            if u["name"].startswith("worker@") == shards and u["pid"]}  # fmt: skip


def daemon_pid(rig: ClusterRig, node: str) -> int:
    return int((rig.state_dir(node) / "dynamod.pid").read_text().split()[0])


def fleet_parts(rig: ClusterRig) -> dict[int, str]:
    """pid -> the fleet's part it is: the head's shards by name (`worker@N`: the first
    shard is known only once it acks), the head's daemon and its other units by name, the
    other nodes' shards, daemons and units (`other nodes' etcd`), the benchmark."""
    parts = {os.getpid(): BENCH}
    for node in rig.names:
        head = node == rig.names[0]
        units = rig.status(node)["units"]
        shards = pids_of(units, shards=True)
        parts |= {pid: unit if head else SHARDS for unit, pid in shards.items()}
        rest = pids_of(units, shards=False)
        parts |= {pid: unit if head else ELSEWHERE + unit for unit, pid in rest.items()}
        parts[daemon_pid(rig, node)] = HEAD_DAEMON if head else DAEMONS
    return parts


class Scan:
    """Every process's stat, read again and again in place (procs.Reread; at 8 x 32 ~600
    processes), so the part of the window outside the stall is that much shorter."""

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self.files: Reread[int, tuple[str, int, float]] = Reread(parse_stat)
        self.read()

    def read(self) -> dict[int, tuple[str, int, float]]:
        """Every process now: pid -> (comm, ppid, CPU seconds so far)."""
        return self.files.read((int(e.name), Path(e.path) / "stat")
                               for e in os.scandir(self.proc) if e.name.isdigit())  # fmt: skip

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> Scan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Split:
    """The processes' CPU over a window (`start` to `stop`), beside the machine's busy time
    over the same window: the two scans are in it, so it is a few ms longer than what it
    brackets. And the head's daemon's and shards' threads' run time and wait for a core
    (their schedstat, in ns: the first shard's is known once it acks). Every file is
    opened when made, before the window. `parts`: fleet_parts. `trace`: also the
    scheduler's events over the window, to say behind whom the first shard and the head's
    daemon waited (fleet_sched; root only)."""

    def __init__(self, parts: dict[int, str], *, trace: bool = False) -> None:
        self.parts = parts
        self.scan = Scan()
        self.waits = Waits([p for p, n in parts.items() if n.startswith("worker@") or
                            n == HEAD_DAEMON])  # fmt: skip
        # the scheduler's events over the window, made here with its buffers (fleet_sched)
        self.trace = SchedTrace() if trace else None
        self.events: list[Event] = []
        self.before: dict[int, tuple[str, int, float]] = {}
        self.after: dict[int, tuple[str, int, float]] = {}
        self.waited: dict[int, dict[str, float]] = {}
        self.window_s = self.busy_s = self.irq_s = math.nan
        self.reads_ms: list[float] = []  # the reads at the window's start and end

    def start(self) -> None:
        with ahead():
            self.host = host.counters()
            self.began = time.monotonic()
            self.before = self.scan.read()
            self.waits.mark()
        self.reads_ms = [(time.monotonic() - self.began) * 1000]
        if self.trace is not None:
            self.trace.on()

    def stop(self) -> None:
        if self.trace is not None:
            self.trace.off()
        stopping = time.monotonic()
        with ahead():
            self.waited = self.waits.since()
            self.after = self.scan.read()
        ended = time.monotonic()
        self.window_s = ended - self.began
        self.reads_ms.append((ended - stopping) * 1000)
        machine = host.window(self.host)
        self.busy_s, self.irq_s = machine["busy_s"], machine["irq_s"]
        if self.trace is not None:
            self.events = parse(self.trace.text())
        self.close()

    def close(self) -> None:
        self.scan.close()
        self.waits.close()
        if self.trace is not None:
            self.trace.close()

    def result(self, first_shard: str | None) -> dict[str, Any]:
        """The window's length (and its two reads'), the machine's busy time in it (and its
        interrupts' part, which is no process's), `spent` by part, and the
        first shard's and the head's daemon's threads' run and wait (ms)."""
        named = {n: p for p, n in self.parts.items()}
        waits = {FIRST: self.waited.get(named.get(first_shard or "", -1)),
                 HEAD_DAEMON: self.waited.get(named.get(HEAD_DAEMON, -1))}  # fmt: skip
        out = {"window_s": self.window_s, "busy_s": self.busy_s, "irq_s": self.irq_s,
               "reads_ms": self.reads_ms,
               "parts": spent(self.before, self.after, self.parts, first_shard),
               "waits": {k: v for k, v in waits.items() if v is not None}}  # fmt: skip
        if self.trace is not None:
            out["behind"] = self.behind(named, first_shard)
        return out

    def behind(self, named: dict[str, int], first_shard: str | None) -> dict[str, Any]:
        """Behind whom the first shard's and the head's daemon's threads waited for a core
        between the trace's on and off (fleet_sched.behind), by the fleet's parts."""
        assert self.trace is not None

        def part(tgid: int, name: str) -> str:
            return part_of(tgid, name, self.after, self.parts, first_shard)

        pids = {FIRST: named.get(first_shard or ""), HEAD_DAEMON: named.get(HEAD_DAEMON)}
        schedule = Schedule(self.events, self.trace.began, self.trace.ended)
        return {"events": len(self.events), "window_s": self.trace.ended - self.trace.began,
                **{whose: schedule.behind(pid, part)
                   for whose, pid in pids.items() if pid is not None}}  # fmt: skip


@contextlib.contextmanager
def ahead(nice: int = AHEAD_NICE, autogroup: Path = PROC / "self" / "autogroup") -> Iterator[None]:
    """This thread, and this process's session where the kernel weighs sessions as one
    (its autogroup), at `nice` for the block, then back: the reads around a stall take
    ~5 ms of CPU, and waiting their turn at nice 0 on the fleet's busy cores they took
    41-135 ms after an 8 x 32 stall, the window that much longer than the stall. Where
    this process may not raise its priority (not root), the block runs as it is."""
    thread = os.getpriority(os.PRIO_PROCESS, 0)
    group: str | None = None
    with contextlib.suppress(OSError):
        group = autogroup.read_text().split("nice")[-1].strip()
        autogroup.write_text(str(nice))
    raised = False
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        raised = True
    try:
        yield
    finally:
        if raised:
            os.setpriority(os.PRIO_PROCESS, 0, thread)
        if group is not None:
            with contextlib.suppress(OSError):
                autogroup.write_text(group)


def spent(
    before: dict[int, tuple[str, int, float]],
    after: dict[int, tuple[str, int, float]],
    parts: dict[int, str],
    first_shard: str | None,
) -> dict[str, float]:
    """CPU seconds in the window by part: `parts` (fleet_parts) with the head's shard
    named `first_shard` as FIRST and its others as HEAD_SHARDS; a process of none of them goes
    to its nearest ancestor's part, or else by its command's name (digits dropped). A
    process born in the window counts from 0; one that ended in it is not seen."""
    out: dict[str, float] = defaultdict(float)
    for pid, (comm, _, cpu) in after.items():
        used = cpu - before[pid][2] if pid in before else cpu
        if used <= 0:
            continue
        out[part_of(pid, comm, after, parts, first_shard)] += used
    return dict(out)


def part_of(
    pid: int,
    comm: str,
    procs: dict[int, tuple[str, int, float]],
    parts: dict[int, str],
    first_shard: str | None,
) -> str:
    """The part a process belongs to: its own, its nearest ancestor's, else its comm's."""
    seen = set()
    at = pid
    while at > 1 and at not in seen:
        if at in parts:  # a unit that ended in the window still owns its children
            name = parts[at]
            if name.startswith("worker@"):  # one of the head's shards
                return FIRST if name == first_shard else HEAD_SHARDS
            return name
        if at not in procs:
            break
        seen.add(at)
        at = procs[at][1]
    return group(comm)


def split_table(
    fleets: list[dict[str, Any]], pushes_of: Callable[[dict[str, Any]], list[dict[str, Any]]]
) -> Table:
    """Per early push (`pushes_of(fleet)`): its stall, the window the processes were read
    over (the stall and the two reads), the machine's busy ms in that window and each
    part's ms of it; the parts outside the fleet's shards, daemons and the bench are in
    the last cell, the largest first."""
    table = Table(
        "Where the machine's cores went in each push answered early: CPU ms by process over "
        "the stall and the two reads around it (/proc, 10 ms ticks; a process outside the "
        "fleet's units counts to its nearest unit ancestor, or by its name)",
        ["nodes", "shards", "step", "stall ms", "window ms (its two reads)",
         "machine busy ms (interrupts)", *PARTS, BENCH,
         "the rest (largest first)",
         "first shard's threads: ran / waited for a core ms (threads ended)",
         "head's daemon's threads: ran / waited ms"],
        digits=0,
    )  # fmt: skip
    for f in fleets:
        for p in pushes_of(f):
            if "cpu_split" not in p:
                continue
            cut = p["cpu_split"]
            split = cut["parts"]
            rest = [k for k in split if k not in (*PARTS, BENCH)]
            table.rows.append(
                [f["nodes"], f["shards"], p["step"], p["stall_s"] * 1000,
                 with_part(cut["window_s"] * 1000, sum(cut.get("reads_ms", [math.nan]))),
                 with_part(cut["busy_s"] * 1000, cut.get("irq_s", math.nan) * 1000),
                 *(split.get(k, 0.0) * 1000 for k in (*PARTS, BENCH)),
                 largest({k: split[k] * 1000 for k in rest}, digits=0),
                 waited(cut, FIRST, ended=True), waited(cut, HEAD_DAEMON)]
            )  # fmt: skip
    return table


def waited(cut: dict[str, Any], part: str, *, ended: bool = False) -> str:
    """A part's threads' run / wait for a core in a split, ms ("-" where not read)."""
    w = cut.get("waits", {}).get(part)
    if w is None:
        return "-"
    text = f"{w['ran_ms']:.1f} / {w['waited_ms']:.1f}"
    return f"{text} ({w['threads_ended']})" if ended else text


def with_part(whole: float, part: float) -> str:
    """`whole (part)` in ms; the part `-` where it was not read."""
    return f"{whole:.0f} ({'-' if math.isnan(part) else f'{part:.0f}'})"


def behind_table(
    fleets: list[dict[str, Any]], pushes_of: Callable[[dict[str, Any]], list[dict[str, Any]]]
) -> Table:
    """Per early push traced (`--sched-trace`): behind whom the first shard's and the head's
    daemon's threads waited for a core in the stall, the largest first; beside the waits'
    sum the same threads' schedstat count (which misses the threads that ended)."""
    table = Table(
        "Behind whom the answer's shard and the head's daemon waited for a core in each push "
        "answered early: ms of their threads' waits by what ran on the core they waited for "
        "(the scheduler's events, tracefs)",
        ["nodes", "shards", "step", "stall ms", "whose", "waits (threads)",
         "waited ms (schedstat's)", "longest ms", "behind its own threads ms",
         "behind others, largest first (ms)", "its threads that waited (ms)"],
        digits=1,
    )  # fmt: skip
    for f in fleets:
        for p in pushes_of(f):
            traced = p.get("cpu_split", {}).get("behind")
            if not traced:
                continue
            for whose in (FIRST, HEAD_DAEMON):
                w = traced.get(whose)
                if w is None:
                    continue
                counted = p["cpu_split"].get("waits", {}).get(whose, {}).get("waited_ms", math.nan)
                others = {k: v for k, v in w["behind_ms"].items() if not k.startswith(OWN)}
                table.rows.append(
                    [f["nodes"], f["shards"], p["step"], p["stall_s"] * 1000, whose,
                     f"{w['waits']} ({w['threads']})", f"{w['waited_ms']:.1f} ({counted:.1f})",
                     w["longest_ms"], own(w["behind_ms"]), largest(others),
                     largest(w["waiting_ms"])]
                )  # fmt: skip
    return table


def largest(ms: dict[str, float], top: int = REST, digits: int = 1) -> str:
    """`name ms, ...` the largest first, the first `top` ("-" for none)."""
    names = sorted(ms, key=lambda k: -ms[k])[:top]
    return ", ".join(f"{k} {ms[k]:.{digits}f}" for k in names) or "-"
