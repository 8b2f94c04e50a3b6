"""What every benchmark shares: flags, statistics, tables, the machine, and safe process
handling (dynamod, supervisord and plain-script stacks that always end, found by marker).

Every process a benchmark starts inherits DYNAMOD_BENCH_MARK=<this run>; the final sweep
SIGKILLs, by pid, only processes carrying that marker. Nothing is ever killed by name.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import datetime as dt
import http.client
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
import xmlrpc.client
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROC = ROOT / "tests" / "fixtures" / "proc.py"
MARK = "DYNAMOD_BENCH_MARK"
NAMESPACE = "dynamod"
MODEL = "tiny-cpu"

# --------------------------------------------------------------------------- flags


def options(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer repetitions, under a minute"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    return parser


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Iterable[float]) -> dict[str, float]:
    data = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not data:
        return {"n": 0, "median": math.nan, "p95": math.nan, "p99": math.nan,
                "min": math.nan, "max": math.nan}
    return {
        "n": len(data),
        "median": statistics.median(data),
        "p95": percentile(data, 95),
        "p99": percentile(data, 99),
        "min": min(data),
        "max": max(data),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- reporting


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    digits: int = 1

    def render(self) -> str:
        cells = [[fmt(c, self.digits) for c in row] for row in self.rows]
        widths = [len(h) for h in self.headers]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        line = "| " + " | ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))
        out = [f"### {self.title}", "", line + " |",
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        for row in cells:
            out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                       + " |")
        return "\n".join(out)


@dataclass
class Report:
    """One benchmark's results: tables for people, `data` for machines, targets judged."""

    name: str
    title: str
    quick: bool
    tables: list[Table] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    load_at_start: list[float] = field(
        default_factory=lambda: [round(x, 2) for x in os.getloadavg()])

    def target(self, name: str, measured: float, limit: float, unit: str,
               *, lower_is_better: bool = True) -> None:
        met = measured <= limit if lower_is_better else measured >= limit
        if math.isnan(measured):
            met = False
        self.targets.append({"target": name, "measured": measured, "limit": limit,
                             "unit": unit, "met": met})

    def as_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "title": self.title,
            "quick": self.quick,
            "seconds": round(time.time() - self.started, 1),
            "machine": machine(),
            "loadavg_at_start": self.load_at_start,
            "command": " ".join([Path(sys.executable).name, "-m", f"bench.{self.name}",
                                 *sys.argv[1:]]),
            "tables": [{"title": t.title, "headers": t.headers, "rows": t.rows,
                        "digits": t.digits} for t in self.tables],
            "targets": self.targets,
            "notes": self.notes,
            "data": self.data,
        }

    def render(self) -> str:
        out = [f"## {self.title}" + (" (quick)" if self.quick else ""), ""]
        for table in self.tables:
            out += [table.render(), ""]
        if self.targets:
            judged = Table("Targets", ["target", "measured", "limit", "met"], digits=3)
            for t in self.targets:
                judged.rows.append([t["target"], f"{fmt(t['measured'], 3)} {t['unit']}",
                                    f"{fmt(t['limit'], 3)} {t['unit']}", t["met"]])
            out += [judged.render(), ""]
        out += [f"- {note}" for note in self.notes]
        out.append(f"\n(took {time.time() - self.started:.0f} s)")
        return "\n".join(out)


def render_json(result: dict[str, Any]) -> str:
    """A benchmark's --json output rendered as its table report again."""
    report = Report(result["benchmark"], result["title"], result["quick"],
                    notes=list(result["notes"]), targets=list(result["targets"]))
    report.tables = [Table(t["title"], t["headers"], t["rows"], digits=t.get("digits", 2))
                     for t in result["tables"]]
    text = report.render()
    return text.rsplit("\n(took", 1)[0] + f"\n(took {result['seconds']:.0f} s)"


def finite(value: Any) -> Any:
    """NaN/inf (a missing measurement) become null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def emit(report: Report, as_json: bool) -> None:
    if as_json:
        data = json.loads(json.dumps(report.as_json(), default=_jsonable))
        print(json.dumps(finite(data), indent=1, allow_nan=False))
    else:
        print(report.render())
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git": rev or None,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


# --------------------------------------------------------------------------- processes


def bench_mark() -> str:
    """This run's marker; set once and inherited by everything we start.

    The benchmark also becomes a child subreaper, so a detached dynamod daemon (orphaned
    when `dynamod up --detach` returns) is re-parented to us and reaped the moment it
    exits, as systemd or a normal init would. This machine's pid 1 reaps orphans only
    every second or two, and `dynamod down` waits until kill(pid, 0) fails, which a
    zombie still passes."""
    mark = os.environ.get(MARK)
    if not mark:
        mark = uuid.uuid4().hex[:12]
        os.environ[MARK] = mark
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        atexit.register(_at_exit)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
    return mark


_PR_SET_CHILD_SUBREAPER = 36


def _at_exit() -> None:
    sweep()
    reap_zombies()


def reap_zombies() -> None:
    """Reap adopted children that have exited (never blocks)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def reap_when_adopted(pid: int) -> None:
    """Reap `pid` the moment it exits; it must already be our (adopted) child."""

    def wait() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=wait, name=f"reap-{pid}", daemon=True).start()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def marked() -> list[int]:
    """Live processes (not us, not zombies) carrying this run's marker."""
    needle = f"{MARK}={os.environ.get(MARK, '')}".encode()
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        if alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def sweep() -> list[int]:
    """SIGKILL every live process carrying this run's marker (by pid); return them."""
    if not os.environ.get(MARK):
        return []
    pids = marked()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    wait_dead(pids, 5)
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


def wait_dead(pids: Iterable[int], timeout: float, interval: float = 0.005) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(interval)
        left = [p for p in left if alive(p)]
    return left


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    if pgid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def started_at(pid: int) -> float:
    """When a process was started, as epoch seconds (kernel clock ticks: 10 ms steps).
    /proc/PID/stat counts from boot; CLOCK_BOOTTIME is the same clock."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def state_dir(prefix: str) -> Iterator[Path]:
    """A short state dir under /tmp (unix socket paths are short), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"b{prefix}-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def iso_epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


# --------------------------------------------------------------------------- dynamod


class Dynamod:
    """The real `dynamod` CLI against one state dir, plus fast status over its socket."""

    def __init__(self, state: Path) -> None:
        bench_mark()
        self.state = state
        from dynamod.control.client import Client

        self.client = Client(state)

    def cli(self, *args: str, timeout: float = 300, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / "dynamod"), "--state-dir", str(self.state), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}\n"
                               f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def up(self, stack: str | Path, *variables: str, timeout: float = 300) -> float:
        """`dynamod up STACK --detach`; returns the wall time until it returned 0."""
        args = ["up", str(stack), "--detach", "--timeout", str(timeout)]
        for var in variables:
            args += ["--var", var]
        started = time.monotonic()
        self.cli(*args, timeout=timeout + 60)
        took = time.monotonic() - started
        pid = self.daemon_pid()
        if pid:
            reap_when_adopted(pid)
        return took

    def daemon_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.state / "dynamod.pid").read_text().strip())
        return None

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.client.status()
        return result

    def unit(self, name: str) -> dict[str, Any]:
        return next(u for u in self.status()["units"] if u["name"] == name)

    def running(self) -> bool:
        return (self.state / "dynamod.sock").exists() and self.client.running()

    def down(self) -> dict[str, Any]:
        out = self.cli("down", "--json", timeout=300, check=False)
        try:
            result: dict[str, Any] = json.loads(out.stdout)
        except ValueError:
            raise RuntimeError(f"dynamod down: {out.stdout[-2000:]} {out.stderr[-2000:]}") \
                from None
        return result

    def run_id(self) -> str | None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            return str(json.loads((self.state / "run.json").read_text())["run_id"])
        return None

    def events(self) -> list[dict[str, Any]]:
        """daemon.log JSON lines, each with `t` (epoch seconds) added."""
        found: list[dict[str, Any]] = []
        path = self.state / "daemon.log"
        if not path.exists():
            return found
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "timestamp" in event:
                event["t"] = iso_epoch(event["timestamp"])
                found.append(event)
        return found

    def transitions(self, unit: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == "unit.state"
                and (unit is None or e.get("unit") == unit)]

    def close(self) -> None:
        """Down if a daemon answers; then SIGKILL anything still carrying its run marker."""
        with contextlib.suppress(Exception):
            if self.running():
                self.down()
        run_id = self.run_id()
        if run_id:
            from dynamod.core.proctable import marked_pids

            for pid in marked_pids(run_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reap_zombies()


# --------------------------------------------------------------------------- supervisord


class Supervisord:
    """The same stack under supervisord, from `dynamod export supervisord`."""

    def __init__(self, state: Path, stack: str | Path, *variables: str) -> None:
        bench_mark()
        self.state = state
        self.conf = state / "supervisord.conf"
        args = [str(BIN / "dynamod"), "--state-dir", str(state), "export", "supervisord",
                str(stack), "--out", str(self.conf)]
        for var in variables:
            args += ["--var", var]
        subprocess.run(args, capture_output=True, text=True, check=True, timeout=60)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rpc(self) -> Any:
        """A fresh XML-RPC proxy over the unix socket (a failed call breaks a proxy)."""
        from supervisor.xmlrpc import SupervisorTransport

        return xmlrpc.client.ServerProxy(
            "http://127.0.0.1",
            transport=SupervisorTransport(None, None, f"unix://{self.state}/supervisord.sock"),
        )

    def config_text(self) -> str:
        return self.conf.read_text()

    def start(self) -> float:
        """Start supervisord; returns time.monotonic() at the spawn."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(BIN / "supervisord"), "-c", str(self.conf)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return started

    def info(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.rpc.supervisor.getAllProcessInfo()
        return result

    def pid(self, program: str) -> int:
        return int(self.rpc.supervisor.getProcessInfo(program)["pid"])

    def wait_rpc(self, timeout: float = 30) -> None:
        def answers() -> bool:
            try:
                self.info()
            except (OSError, xmlrpc.client.Fault, http.client.HTTPException):
                return False
            return True

        wait_until(answers, timeout, 0.02, "supervisord's socket")

    def log_events(self) -> list[tuple[float, str]]:
        """(epoch seconds, message) from supervisord.log (millisecond timestamps)."""
        found: list[tuple[float, str]] = []
        path = self.state / "supervisord.log"
        if not path.exists():
            return found
        for line in path.read_text(errors="replace").splitlines():
            try:
                stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            except ValueError:
                continue
            found.append((stamp.timestamp(), line[24:]))
        return found

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM supervisord (it stops every program, then exits); seconds it took."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        return time.monotonic() - started

    def close(self) -> None:
        if self.proc is not None:
            tree = descendants(self.proc.pid)
            with contextlib.suppress(Exception):
                self.stop(30)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_group(self.proc.pid)


# --------------------------------------------------------------------------- the local stack


def prebuilt_model() -> Path:
    """The tiny model where the stock units look for it (`model_dir`, in dynamod's cache
    dir), built once if missing, so stack benchmarks measure processes, not tokenizer
    builds: the `model` unit then only checks it, for every variant alike."""
    from dynamod.core import paths
    from dynamod.workers.model import ensure_model

    return ensure_model(paths.cache_dir() / "models" / MODEL)


def serve_stack(state: Path) -> Path:
    """The stock `local` stack without its trainer, written into `state`: etcd, NATS, the
    CPU workers and the frontend with local.toml's own vars and [policy]. The trainer runs
    GRPO steps and pushes policy updates by itself; benchmarks drive updates themselves
    and must not share two cores with training. Derived from units/stacks/local.toml at
    run time, so it follows that file."""
    source = ROOT / "units" / "stacks" / "local.toml"
    data = tomllib.loads(source.read_text())
    include = [str((source.parent / i).resolve()) for i in data["stack"]["include"]
               if "trainer" not in Path(i).name]
    lines = ["# generated by bench.common.serve_stack from " + str(source), "[stack]",
             'name = "local-serve"', f"include = {json.dumps(include)}", ""]
    for table in ("vars", "policy"):
        if table in data:
            lines.append(f"[{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in data[table].items()
                      if not k.startswith("trainer")]
            lines.append("")
    path = state / "local-serve.toml"
    path.write_text("\n".join(lines))
    return path


def load_local_stack(state: Path, *variables: str) -> Any:
    """The serve-only local stack rendered the way `dynamod up` renders it (ports
    allocated now)."""
    from dynamod.core import ports, spec

    allocator = ports.PortAllocator()
    return spec.load(
        serve_stack(state),
        state_dir=state.absolute(),
        allocate_port=allocator,
        var_overrides=dict(spec.parse_var(v) for v in variables),
    )


def unit_env(unit_spec: Any) -> dict[str, str]:
    """What a unit's process sees, without dynamod: our environment, the venv's bin dir
    first on PATH (as dynamod and the supervisord export do), and the unit's env."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', os.defpath)}"
    env.update(unit_spec.env)
    return env


async def routable(session: Any, url: str, workers: int, model: str = MODEL) -> bool:
    """The frontend lists `workers` generate instances and the model: fully ready."""
    from dynamod.rollout import dynamo

    try:
        instances = await dynamo.frontend_routed_instances(session, url, NAMESPACE,
                                                           timeout_s=1.0)
        if len(instances) < workers:
            return False
        models = await dynamo.frontend_models(session, url, timeout_s=1.0)
    except (TimeoutError, dynamo.DynamoHTTPError, OSError):
        return False
    return model in models


def wait_routable(url: str, workers: int, timeout: float = 120, interval: float = 0.02
                  ) -> float:
    """Poll until fully routable; returns time.monotonic() at the first success."""
    import aiohttp

    async def poll() -> float:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if await routable(session, url, workers):
                    return time.monotonic()
                await asyncio.sleep(interval)
        raise TimeoutError(f"{url} not routable with {workers} workers after {timeout:g}s")

    return asyncio.run(poll())


@dataclass
class Outcome:
    sent_at: float  # seconds since the load started
    status: int  # HTTP status, -1 for a connection error / timeout
    latency: float
    error: str = ""


async def steady_load(url: str, rate: float, seconds: float, *, on_tick: Callable[[float], Any]
                      | None = None, max_tokens: int = 8) -> list[Outcome]:
    """`rate` completions/s for `seconds` (bounded: rate*seconds requests, 30 s timeout
    each). `on_tick(elapsed)` is awaited-free and called before each send."""
    import aiohttp

    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()

        async def one(i: int) -> None:
            sent = time.monotonic()
            body = {"model": MODEL, "prompt": f"benchmark request {i}", "max_tokens": max_tokens}
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    text = await resp.text()
                    outcomes.append(Outcome(sent - start, resp.status, time.monotonic() - sent,
                                            "" if resp.status == 200 else text[:200]))
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcomes.append(Outcome(sent - start, -1, time.monotonic() - sent, repr(exc)))

        tasks = []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            if on_tick is not None:
                on_tick(time.monotonic() - start)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return sorted(outcomes, key=lambda o: o.sent_at)


class PlainStack:
    """The stack's commands started by a plain script: no supervisor, no restarts.

    Units start in dependency order (the stack's own order), each only once the previous
    tier answers, so the stack is fully up before anything is measured; nothing watches
    them afterwards."""

    def __init__(self, stack: Any) -> None:
        bench_mark()
        self.stack = stack
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str) -> subprocess.Popen[bytes]:
        spec = self.stack.units[name]
        log_dir = Path(tempfile.gettempdir())
        log = open(log_dir / f"dmbench-plain-{os.environ[MARK]}-{name}.log", "ab")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                list(spec.command), env=unit_env(spec), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=spec.cwd or None,
            )
        self.procs[name] = proc
        return proc

    def close(self) -> None:
        for proc in self.procs.values():
            kill_group(proc.pid, signal.SIGTERM)
        wait_dead([p.pid for p in self.procs.values()], 5)
        for proc in self.procs.values():
            kill_group(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for path in Path(tempfile.gettempdir()).glob(f"dmbench-plain-{os.environ[MARK]}-*"):
            path.unlink(missing_ok=True)
