"""Behind whom a process's threads waited for a core: the kernel's scheduler events over a
window, from a tracefs instance of this benchmark's own (`SchedTrace`), and each wait put
to what ran meanwhile on the core whose queue the thread waited in (`behind`).

A thread waits for a core from its wake-up (`sched_wakeup`, or `sched_wakeup_new` for a
new one) or from being preempted (`sched_switch` away from it while it could run) until it
is switched in. Meanwhile it sits in one core's run queue: the wake-up's target core, moved
by `sched_migrate_task`. Whatever ran on that core in that time (`sched_switch`'s record
of each core) is what it waited behind; the core idle meanwhile is the wake-up's own
latency (the idle core still has to switch to it). The schedstat counts (fleet_threads.Waits)
say how long a thread waited; this says behind whom, and it sees the threads that ended
in the window too (their wait is in the trace, not in any file left to read).

Only root may trace; where tracefs is not mounted, it is mounted for the trace and taken
down after, by the last trace of any bench to close (`LOCK`: a trace holds it shared while
it lives, and says in it that a bench mounted tracefs). The instance and its buffers are
removed when the trace is closed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from bench.fleet_threads import group as thread_group

TRACEFS = Path("/sys/kernel/tracing")
FILESYSTEMS = Path("/proc/filesystems")
EVENTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_migrate_task")
BUFFER_KB = 16384  # per core: an 8 x 32 stall of ~0.2 s writes a few MB on each
PREFIX = "dynamod-bench-"  # an instance's name, before the pid of the bench it is for
# Held shared by every live trace, exclusively while one mounts tracefs or takes it down;
# "mounted" in it: a bench mounted tracefs, and the last trace to close takes it down
# (concurrent traces, the suite's two workers at once, left it mounted before)
LOCK = Path("/run/dynamod-bench-tracefs.lock")
IDLE = "idle (the wake-up's latency)"
OWN = "its own threads"  # `its own threads: <their name>` in `behind`

# `comm-tid (tgid) [cpu] flags timestamp: event: fields` (options/record-tgid); the idle
# task's tgid is `-------`
LINE = re.compile(
    r"^\s*(?P<comm>.*?)-(?P<tid>\d+)\s+\(\s*(?P<tgid>[-\d]+)\)\s+\[(?P<cpu>\d+)\]\s+\S+\s+"
    r"(?P<ts>\d+\.\d+):\s+(?P<event>\w+):\s+(?P<fields>.*)$"
)
SWITCH = re.compile(
    r"prev_comm=(?P<prev_comm>.*?) prev_pid=(?P<prev_pid>\d+) prev_prio=-?\d+ "
    r"prev_state=(?P<prev_state>\S+) ==> next_comm=(?P<next_comm>.*?) "
    r"next_pid=(?P<next_pid>\d+) next_prio=-?\d+"
)
WAKEUP = re.compile(r"comm=(?P<comm>.*?) pid=(?P<pid>\d+) prio=-?\d+ target_cpu=(?P<cpu>\d+)")
MIGRATE = re.compile(
    r"comm=(?P<comm>.*?) pid=(?P<pid>\d+) prio=-?\d+ orig_cpu=\d+ dest_cpu=(?P<cpu>\d+)"
)


class TraceError(RuntimeError):
    """The scheduler's trace could not be set up (one line, what and where)."""


def missing(filesystems: Path = FILESYSTEMS, root: Path = TRACEFS) -> str | None:
    """Why the scheduler cannot be traced here, or None."""
    if os.geteuid() != 0:
        return "tracing the scheduler needs root"
    try:
        if "tracefs" not in filesystems.read_text():
            return "this kernel has no tracefs"
    except OSError as exc:
        return f"cannot read {filesystems}: {exc.strerror}"
    if not root.is_dir():
        return f"no {root} to mount tracefs on"
    return None


class SchedTrace:
    """A tracefs instance recording EVENTS between `on` and `off` (the monotonic clock,
    each event with its task's process id). Made before a window, so that the window
    holds only the two writes that switch it on and off."""

    def __init__(self, root: Path = TRACEFS, buffer_kb: int = BUFFER_KB,
                 lock: Path = LOCK) -> None:
        self.root = root
        self.lock = lock
        self.dir = root / "instances" / f"{PREFIX}{os.getpid()}"
        self.began = self.ended = 0.0
        self._made = False  # its instance
        self._held = locked(lock, fcntl.LOCK_SH)  # shared with every other live trace
        try:
            if not (root / "instances").is_dir():
                fcntl.flock(self._held, fcntl.LOCK_EX)  # alone while it mounts
                self._mount()
            sweep(root)
            self.dir.mkdir()
            self._made = True
            self._write("tracing_on", "0")
            self._write("trace_clock", "mono")  # time.monotonic()'s clock
            self._write("options/record-tgid", "1")
            self._write("buffer_size_kb", str(buffer_kb))
            for event in EVENTS:
                self._write(f"events/sched/{event}/enable", "1")
            # shared again (if it mounted): its instance is there already, so a close that
            # slips in while the lock changes hands leaves tracefs mounted
            fcntl.flock(self._held, fcntl.LOCK_SH)
        except BaseException:
            self.close()
            raise

    def _mount(self) -> None:
        """Mount tracefs (unless another trace did, just before), and say in the lock
        that a bench did."""
        if (self.root / "instances").is_dir():
            return
        done = subprocess.run(["mount", "-t", "tracefs", "nodev", str(self.root)],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if done.returncode != 0:
            raise TraceError(f"cannot mount tracefs on {self.root}: {done.stderr.strip()}")
        self._held.seek(0)
        self._held.truncate()
        self._held.write("mounted\n")
        self._held.flush()

    def _write(self, name: str, value: str) -> None:
        write(self.dir, name, value)

    def on(self) -> None:
        self._write("trace", "")  # an empty buffer
        self.began = time.monotonic()
        self._write("tracing_on", "1")

    def off(self) -> None:
        self._write("tracing_on", "0")
        self.ended = time.monotonic()

    def text(self) -> str:
        return (self.dir / "trace").read_text(errors="replace")

    def close(self) -> None:
        """Remove the instance (its buffers with it); the last trace to close takes
        tracefs down if a bench mounted it, and removes the lock."""
        if self._made:
            remove(self.dir)
            self._made = False
        if self._held.closed:
            return
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another trace lives: the last one takes it down
            self._held.close()
            return
        try:
            others = [i for i in (self.root / "instances").glob(f"{PREFIX}*")
                      if Path(f"/proc/{i.name[len(PREFIX):]}").exists()]  # live benches
            self._held.seek(0)
            if not others and self._held.read().strip() == "mounted":
                subprocess.run(["umount", str(self.root)], check=False, capture_output=True,
                               timeout=10)  # fmt: skip
            if not others:
                with contextlib.suppress(FileNotFoundError):
                    self.lock.unlink()
        finally:
            self._held.close()

    def __enter__(self) -> SchedTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write(instance: Path, name: str, value: str) -> None:
    (instance / name).write_text(value)


def locked(path: Path, how: int) -> TextIO:
    """`path` opened (made if missing) and flock'ed `how`; opened again when the file
    locked was removed meanwhile (a last trace's close removes it)."""
    while True:
        held = open(path, "a+")  # noqa: SIM115 - kept open for the trace's life
        fcntl.flock(held, how)
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(held.fileno()).st_ino == os.stat(path).st_ino:
                return held
        held.close()


def remove(instance: Path) -> None:
    """Stop an instance's recording and remove it with its buffers (gone already: done)."""
    with contextlib.suppress(OSError):
        write(instance, "tracing_on", "0")
        for event in EVENTS:
            write(instance, f"events/sched/{event}/enable", "0")
    with contextlib.suppress(FileNotFoundError):
        instance.rmdir()


def sweep(root: Path) -> list[Path]:
    """Remove the instances a bench that ended without closing its trace left (killed):
    one records on in the kernel, mounted or not, until it is removed."""
    gone = []
    for instance in (root / "instances").glob(f"{PREFIX}*"):
        pid = instance.name[len(PREFIX) :]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove(instance)
            gone.append(instance)
    return gone


@dataclass(frozen=True)
class Event:
    """One scheduler event: the task it ran in (`tid`, its process `tgid`, None for the
    idle task), the core, the time (s), its kind and its fields."""

    tid: int
    tgid: int | None
    cpu: int
    ts: float
    kind: str
    fields: dict[str, str]


def parse(text: str) -> list[Event]:
    """A trace's events in its order (the time's), the lines that are none skipped."""
    out = []
    patterns = {"sched_switch": SWITCH, "sched_wakeup": WAKEUP, "sched_wakeup_new": WAKEUP,
                "sched_migrate_task": MIGRATE}  # fmt: skip
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None or m["event"] not in patterns:
            continue
        fields = patterns[m["event"]].match(m["fields"])
        if fields is None:
            continue
        tgid = None if m["tgid"].startswith("-") else int(m["tgid"])
        out.append(Event(int(m["tid"]), tgid, int(m["cpu"]), float(m["ts"]), m["event"],
                         fields.groupdict()))  # fmt: skip
    return out


@dataclass(frozen=True)
class Wait:
    """Part of a thread's wait for a core: in `cpu`'s queue from `start` to `end` (s), of
    the wait that began at `since` (a wait moved to another core's queue is two parts)."""

    tid: int
    cpu: int
    start: float
    end: float
    since: float


def tasks(events: Iterable[Event], proc: Path = Path("/proc")) -> dict[int, tuple[int | None, str]]:
    """tid -> (its process, its name) of every task in the events: the process from the
    events it ran in, else (a thread seen only switched in) from /proc while it lives."""
    out: dict[int, tuple[int | None, str]] = {}
    for e in events:
        if e.kind == "sched_switch":
            for side in ("prev", "next"):
                tid = int(e.fields[f"{side}_pid"])
                out.setdefault(tid, (None, e.fields[f"{side}_comm"]))
    for e in events:
        if e.tgid is not None and e.tid in out:
            out[e.tid] = (e.tgid, out[e.tid][1])
    for tid, (tgid, comm) in out.items():
        if tgid is None and tid:
            with contextlib.suppress(OSError, ValueError, StopIteration):
                status = (proc / str(tid) / "status").read_text()
                line = next(x for x in status.splitlines() if x.startswith("Tgid:"))
                out[tid] = (int(line.split()[1]), comm)
    return out


def waits(events: list[Event], tids: set[int], end: float) -> list[Wait]:
    """Every wait for a core of the threads `tids`, cut at `end`, a part for each core's
    queue it waited in. A thread already waiting when the trace began is seen only from
    its next wake-up or preemption."""
    queued: dict[int, tuple[int, float, float]] = {}  # tid -> (its queue's core, from, since)
    running: set[int] = set()
    out = []
    for e in events:
        f = e.fields
        if e.kind == "sched_switch":
            prev, nxt = int(f["prev_pid"]), int(f["next_pid"])
            running.discard(prev)
            # a wake-up while it still ran (about to sleep, or from before the trace) was
            # no wait: it switches out, not in
            queued.pop(prev, None)
            if nxt in queued:
                cpu, start, since = queued.pop(nxt)
                out.append(Wait(nxt, e.cpu, start, e.ts, since))
            running.add(nxt)
            if prev in tids and f["prev_state"].startswith("R"):  # preempted, still runnable
                queued[prev] = (e.cpu, e.ts, e.ts)
            continue
        tid = int(f["pid"])
        if tid not in tids or (tid in running and e.kind != "sched_migrate_task"):
            continue
        if e.kind == "sched_migrate_task":
            if tid in queued:  # the wait goes on in another core's queue
                cpu, start, since = queued[tid]
                out.append(Wait(tid, cpu, start, e.ts, since))
                queued[tid] = (int(f["cpu"]), e.ts, since)
        elif tid not in queued:
            queued[tid] = (int(f["cpu"]), e.ts, e.ts)
    out += [Wait(tid, cpu, start, end, since) for tid, (cpu, start, since) in queued.items()
            if start < end]  # fmt: skip
    return out


def occupants(
    events: list[Event], begin: float, end: float
) -> dict[int, list[tuple[float, float, int]]]:
    """Per core, who ran on it when: (from, to, tid), tid 0 the idle task; each core from
    its first switch in the trace (what ran before it ran since `begin`) to `end`."""
    out: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    since: dict[int, float] = {}
    running: dict[int, int] = {}
    for e in events:
        if e.kind != "sched_switch":
            continue
        out[e.cpu].append((since.get(e.cpu, begin), e.ts, int(e.fields["prev_pid"])))
        since[e.cpu], running[e.cpu] = e.ts, int(e.fields["next_pid"])
    for cpu, tid in running.items():
        out[cpu].append((since[cpu], end, tid))
    return dict(out)


class Schedule:
    """A trace's tasks (`tasks`) and who ran on each core between `begin` and `end`
    (`occupants`), read once for every process asked after (`behind`)."""

    def __init__(
        self, events: list[Event], begin: float, end: float, proc: Path = Path("/proc")
    ) -> None:
        self.events, self.begin, self.end = events, begin, end
        self.known = tasks(events, proc)
        self.ran = occupants(events, begin, end)

    def behind(self, tgid: int, part: Callable[[int, str], str]) -> dict[str, Any]:
        """The waits for a core of process `tgid`'s threads in the window: how many, their
        sum and longest (ms), and the ms by what ran on their core meanwhile: `part(tgid,
        name)` names another process's part (the task's name where its process is not
        known: an ended thread seen only switched in), this process's own threads are OWN
        with their name (digits dropped) and the idle task IDLE; and the ms by which of its
        threads waited (their names)."""
        known = self.known
        mine = {tid for tid, (group, _) in known.items() if group == tgid}
        found = [w for w in waits(self.events, mine, self.end) if w.end > self.begin]
        by: dict[str, float] = defaultdict(float)
        each: dict[tuple[int, float], float] = defaultdict(float)  # a wait's parts summed
        for w in found:
            start = max(w.start, self.begin)
            each[(w.tid, w.since)] += w.end - start
            for lo, hi, tid in self.ran.get(w.cpu, []):
                overlap = min(hi, w.end) - max(lo, start)
                if overlap > 0:
                    group, name = known.get(tid, (None, "?"))
                    who = (IDLE if tid == 0 else f"{OWN}: {thread_group(name)}" if group == tgid
                           else part(group or -1, name))  # fmt: skip
                    by[who] += overlap * 1000
        waiting: dict[str, float] = defaultdict(float)  # which of its threads waited
        for (tid, _), seconds in each.items():
            waiting[thread_group(known[tid][1])] += seconds * 1000
        return {"waits": len(each), "threads": len({tid for tid, _ in each}),
                "waited_ms": sum(each.values()) * 1000,
                "longest_ms": max(each.values(), default=0.0) * 1000,
                "behind_ms": dict(by), "waiting_ms": dict(waiting)}  # fmt: skip


def behind(
    events: list[Event],
    tgid: int,
    begin: float,
    end: float,
    part: Callable[[int, str], str],
    proc: Path = Path("/proc"),
) -> dict[str, Any]:
    """`Schedule.behind` for one process."""
    return Schedule(events, begin, end, proc).behind(tgid, part)


def own(behind_ms: dict[str, float]) -> float:
    """The ms a process's threads waited behind one another (`behind`'s OWN parts)."""
    return sum(ms for who, ms in behind_ms.items() if who.startswith(OWN))
