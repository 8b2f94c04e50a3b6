"""Benchmark 17 - goodput under faults, measured by AIPerf while a fault is injected.

    python -m bench.goodput [--quick] [--json] [--concurrency 4,16]
                            [--supervisors dynamod,supervisord,none]   (make bench-goodput)
                            [--faults worker_kill,...|none] [--rounds N]

AIPerf (`aiperf profile`, from .venv-aiperf: `make install-aiperf`; the benchmark refuses
in one line without it) drives the serve-only default stack (2 CPU workers, the stock
frontend) over the frontend's OpenAI API: streaming chat, synthetic 32-token prompts and
32-token outputs, at concurrency 4 and 16, for RUN_S seconds; FAULT_AT_S seconds into the
run one fault:

  worker_kill    worker@1 kill -9
  worker_stop    worker@1 SIGSTOP for 10 s, then SIGCONT
  frontend_kill  the frontend kill -9
  etcd_kill      etcd kill -9
  push           `dynamod policy push` every second to the run's end (dynamod only:
                 neither supervisord nor plain processes have a push)

Side by side in one run, one after the other: dynamod, supervisord (the config `dynamod
export supervisord` writes) and no supervisor (bench.load_kill's plain processes, the
recipe's way: nothing restarts them; a stack left broken is started again before the next
run). Per fault and supervisor, from AIPerf's own exports (per-request records and the
summary, never its console): requests failed, TTFT and ITL p50/p99 against the fault-free
run of the same stack, goodput (requests/s meeting the SLOs in GOODPUT, AIPerf's
--goodput), and the seconds from the fault until goodput is back to 95 % of the fault-free
run's (bench.aiperf_run.recovery_s; "never" if not within the run).

--quick: worker_kill only, concurrency 4, dynamod only, a QUICK_RUN_S run; the fault-free
reference is the run's own requests before the fault. --concurrency 4 and --supervisors
dynamod,none narrow the full profile (each ~1-2 min per fault and supervisor here);
--faults names the faults to inject (`none`: the fault-free runs alone). --rounds N runs
the whole plan N times, the supervisors taking turns in each round, and adds a table of
each supervisor's fault-free goodput over the rounds against no supervisor's: the one way
to tell a supervisor's own cost from this machine's speed, which moves between runs. Only
one supervisor's stack is up at a time: another's idle processes would share the cores.
"""

from __future__ import annotations

import itertools
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import aiperf_run, goodput_plot, host
from bench.aiperf_run import Load, Record
from bench.load_kill import DynamodVariant, PlainVariant, SupervisordVariant, Variant
from bench.procs import bench_mark, kill_group, state_dir, sweep, wait_until
from bench.recovery import make_checkpoint
from bench.report import Report, Table, emit, entry, options, percentile, program
from bench.stack import MODEL, prebuilt_model, wait_routable

FAULTS = {
    "worker_kill": "worker@1 kill -9",
    "worker_stop": "worker@1 SIGSTOP 10 s, then SIGCONT",
    "frontend_kill": "frontend kill -9",
    "etcd_kill": "etcd kill -9",
    "push": "a policy push every second",
}
VICTIM = "worker@1"
STOP_S = 10.0
RUN_S, FAULT_AT_S = 30.0, 8.0
QUICK_RUN_S, QUICK_FAULT_AT_S = 8.0, 3.0
CONCURRENCY = (4, 16)
# The SLOs a good request meets (AIPerf's --goodput): TTFT and ITL in ms. Chosen for the
# tiny CPU model on 2 cores: 1.8-3x the fault-free TTFT p99 and 1.5x the ITL p99 at
# concurrency 16 on the dev machine, so a fault-free run is all good and a stalled request
# is not (docs/benchmarks.md, 17).
TTFT_SLO_MS, ITL_SLO_MS = 1500.0, 50.0
WORKERS = 2
WARMUP_S = 1.0  # the first requests of a run, left out of its pre-fault goodput
WINDOW_STEP_S = 0.5  # the goodput picture's windows start this far apart
MIGRATION_LIMIT = 3  # the stock frontend's


# --------------------------------------------------------------------------- the stacks


class Faultable:
    """What a fault needs of a stack beside bench.load_kill's Variant."""

    def pid(self, unit: str) -> int:
        raise NotImplementedError

    def push(self, step: int) -> None:
        raise NotImplementedError(f"{self} has no policy push")


class DynamodRun(DynamodVariant, Faultable):
    def up(self) -> None:
        super().up()
        self.checkpoint = make_checkpoint(self.state)

    def pid(self, unit: str) -> int:
        return int(self.dm.unit(unit)["pid"])

    def push(self, step: int) -> None:
        self.dm.cli("policy", "push", "--step", str(step), "--path", str(self.checkpoint))


class SupervisordRun(SupervisordVariant, Faultable):
    def pid(self, unit: str) -> int:
        return self.sd.pid(unit)


class PlainRun(PlainVariant, Faultable):
    def pid(self, unit: str) -> int:
        return self.plain.procs[unit].pid

    def dead(self) -> list[str]:
        return [n for n, p in self.plain.procs.items() if p.poll() is not None and n != "model"]


RUNS: list[type[Variant]] = [DynamodRun, SupervisordRun, PlainRun]


def serving(run: Variant, timeout: float) -> bool:
    """The stack serves again with every worker routed (and, without a supervisor, nothing
    it started has died)."""
    if isinstance(run, PlainRun) and run.dead():
        return False
    try:
        wait_routable(run.url, WORKERS, timeout=timeout)
    except TimeoutError:
        return False
    return True


# --------------------------------------------------------------------------- faults


class Injector(threading.Thread):
    """Injects `fault` into `run` at `at` (time.time()); `at` is kept as injected."""

    def __init__(self, run: Any, fault: str, delay: float, until: float) -> None:
        super().__init__(daemon=True, name=f"fault-{fault}")
        self.run_, self.fault, self.delay, self.until = run, fault, delay, until
        self.at = float("nan")
        self.pushes: list[float] = []  # seconds each push took
        self.push_failures: list[str] = []
        self.error = ""

    def run(self) -> None:
        time.sleep(self.delay)
        try:
            self.inject()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:300]

    def inject(self) -> None:
        import os
        import signal

        if self.fault == "push":
            self.push_every_second()
            return
        unit = {"frontend_kill": "frontend", "etcd_kill": "etcd"}.get(self.fault, VICTIM)
        pid = self.run_.pid(unit)
        self.at = time.time()
        if self.fault != "worker_stop":
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    def push_every_second(self) -> None:
        self.at = time.time()
        step = getattr(self.run_, "next_step", 1)
        while time.time() < self.until:
            started = time.time()
            try:
                self.run_.push(step)
                self.pushes.append(time.time() - started)
            except Exception as exc:  # a failed push is a result
                self.push_failures.append(f"step {step}: {type(exc).__name__}: {exc}"[:200])
            step += 1
            time.sleep(max(0.0, started + 1.0 - time.time()))
        self.run_.next_step = step


# --------------------------------------------------------------------------- one AIPerf run


def wait_profiling(proc: subprocess.Popen[bytes], artifacts: Path, timeout: float = 240) -> None:
    """Until aiperf says it sends (its log's state line: timing only, no results)."""
    log = artifacts / "logs" / "aiperf.log"

    def started() -> bool:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
            raise aiperf_run.AiperfError(f"aiperf exited {proc.returncode} before sending: {tail}")
        return log.exists() and "AIPerf System is PROFILING" in log.read_text(errors="replace")

    wait_until(started, timeout, 0.1, f"aiperf to start sending ({log})")


def drive(run: Variant, load: Load, fault: str | None, fault_at: float, work: Path) -> Any:
    """One aiperf run against `run`, `fault` injected `fault_at` s into it; its records,
    summary and the injector (None without a fault)."""
    name = f"{run.name.replace(' ', '-')}-{fault or 'none'}-c{load.concurrency}"
    artifacts = next(work / f"{name}-{n}" for n in itertools.count(1)  # a round each
                     if not (work / f"{name}-{n}").exists())  # fmt: skip
    artifacts.mkdir(parents=True)
    env = aiperf_run.environment(work / "hf")
    env["TMPDIR"] = str(work)  # aiperf's mmap dirs go with the work dir
    with (artifacts / "console.txt").open("wb") as console:
        proc = subprocess.Popen(
            aiperf_run.command(load, artifacts), env=env, stdin=subprocess.DEVNULL,
            stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    injector = None
    clock = {"spawned": time.monotonic()}
    try:
        wait_profiling(proc, artifacts)
        clock["sending"], machine = time.monotonic(), host.counters()
        if fault is not None:
            until = time.time() + load.seconds
            injector = Injector(run, fault, fault_at, until)
            injector.start()
        proc.wait(load.seconds + load.grace_s + 180)
        clock["exited"], machine_used = time.monotonic(), host.window(machine)
        if injector is not None:
            injector.join(STOP_S + 30)
    finally:
        kill_group(proc.pid)
        proc.wait(10)
    records = aiperf_run.read_records(artifacts / aiperf_run.RECORDS)
    summary: dict[str, Any] = dict(aiperf_run.read_summary(artifacts / aiperf_run.SUMMARY))
    summary["aiperf_start_s"] = clock["sending"] - clock["spawned"]
    summary["aiperf_wall_s"] = clock["exited"] - clock["spawned"]
    summary["host"] = machine_used  # while it sent: steal, kdamond, pages read back in
    return records, summary, injector


def measured(
    name: str, load: Load, records: list[Record], summary: dict[str, float], injector: Any
) -> dict[str, Any]:
    start = records[0].start if records else float("nan")
    failed = [r for r in records if not r.ok]
    out: dict[str, Any] = {
        "supervisor": name,
        "concurrency": load.concurrency,
        "records": len(records),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:4],
        "start": start,
        "run_end": start + load.seconds,
        **summary,
    }
    if injector is not None:
        at = injector.at
        out.update(
            fault_at_s=injector.at - start,
            fault_error=injector.error,
            pushes=len(injector.pushes),
            push_s=sorted(injector.pushes),
            push_failures=injector.push_failures[:4],
            failed_before=sum(1 for r in failed if r.end < at),
            failed_in_flight=sum(1 for r in failed if r.start < at <= r.end),
            failing_until_s=max([r.end - at for r in failed if r.end >= at] or [0.0]),
        )
    return out


def before_fault(records: list[Record], fault: float) -> dict[str, float]:
    """The quick profile's fault-free reference: the run's own requests that ended
    before the fault."""
    pre = [r for r in records if r.end < fault]
    ttft = [r.ttft_ms for r in pre if r.ok]
    itl = [r.itl_ms for r in pre if r.ok]
    start = records[0].start if records else fault
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "goodput_rps": aiperf_run.good_rate(records, start, fault),
        "failed": float(sum(1 for r in pre if not r.ok)),
        "requests": float(len(pre)),
    }


def recovery(result: dict[str, Any], records: list[Record], quick: bool) -> None:
    """Seconds until goodput is back to 95 % of the run's own goodput before the fault
    (from WARMUP_S after its first request; the same machine load as the fault's, where a
    separate fault-free run on a shared machine differs by +/-30 %), into `result`."""
    fault = result["start"] + result.get("fault_at_s", math.nan)
    result["pre_fault_goodput_rps"] = aiperf_run.good_rate(
        records, result["start"] + WARMUP_S, fault
    )
    baseline = result["pre_fault_goodput_rps"]
    if math.isnan(fault) or not baseline > 0:  # no fault injected, or nothing good before
        result["recovery_s"] = None
        return
    result["recovery_s"] = aiperf_run.recovery_s(
        records, fault, result["run_end"], baseline, window=2.0 if quick else 3.0
    )


def noise_floor(records: list[Record], reference: dict[str, Any]) -> float | None:
    """"s to 95 %" judged on the fault-free run as if its fault came at FAULT_AT_S: what
    the figure reads with no fault at all. The judgment takes the first window below 95 %
    anywhere after the fault, so a dip of the machine's own 18 s after a fault that cost
    nothing reads as 18 s; this puts that noise beside each fault's figure."""
    judged = {**reference, "fault_at_s": FAULT_AT_S}  # a copy: the run keeps no fault
    recovery(judged, records, quick=False)
    return judged["recovery_s"]  # type: ignore[no-any-return]


def windows(records: list[Record], result: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The run's goodput in the windows `recovery` judges (every WINDOW_STEP_S from the
    run's start), for its picture (bench.goodput_plot)."""
    window = 2.0 if quick else 3.0
    rps = aiperf_run.good_series(records, result["start"], result["run_end"], window,
                                 WINDOW_STEP_S)  # fmt: skip
    return {"window_s": window, "step_s": WINDOW_STEP_S, "rps": rps}


# --------------------------------------------------------------------------- the runs


class Stacks:
    """One stack per supervisor, started again when a fault left it broken."""

    def __init__(self) -> None:
        self.up: dict[str, Variant] = {}
        self.restarts: dict[str, int] = {}

    def get(self, cls: type[Variant]) -> Variant:
        for name in [n for n in self.up if n != cls.name]:  # one stack up at a time: an
            self.up.pop(name).cleanup()  # idle one's probes and loops share the cores
        run = self.up.get(cls.name)
        if run is not None and serving(run, 90):
            return run
        if run is not None:
            run.cleanup()
            self.restarts[cls.name] = self.restarts.get(cls.name, 0) + 1
        run = cls(WORKERS, MIGRATION_LIMIT)
        run.up()
        self.up[cls.name] = run
        return run

    def close(self) -> None:
        for run in self.up.values():
            run.cleanup()
        sweep()


def plan(args: Any) -> tuple[list[type[Variant]], tuple[int, ...], list[str]]:
    """What runs: the quick profile, or the full one narrowed by --concurrency and
    --supervisors."""
    if args.quick:
        return [DynamodRun], (4,), ["worker_kill"]
    runs = [cls for cls in RUNS if cls.name in args.supervisors]
    return runs, tuple(args.concurrency), list(args.faults)


def parse_args() -> Any:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", type=_levels, default=list(CONCURRENCY),
        help="AIPerf concurrencies, comma-separated (full profile; default 4,16)",
    )  # fmt: skip
    parser.add_argument(
        "--supervisors", type=_names, default=[cls.name for cls in RUNS],
        help="comma-separated, of: dynamod, supervisord, none (full profile; default all)",
    )  # fmt: skip
    parser.add_argument(
        "--faults", type=_faults, default=list(FAULTS),
        help=f"comma-separated, of: {', '.join(FAULTS)}; or none, for the fault-free runs "
        "alone (full profile; default all)",
    )  # fmt: skip
    parser.add_argument(
        "--png", type=Path, default=None, metavar="DIR",
        help="also draw each fault's goodput over time, the supervisors side by side, into "
        "DIR/goodput-FAULT.png (bench.goodput_plot; it redraws them from a --json output)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=_rounds, default=1,
        help="run the plan N times, the supervisors taking turns in each (full profile; "
        "default 1)",
    )  # fmt: skip
    return parser.parse_args()


def _faults(text: str) -> list[str]:
    if text == "none":
        return []
    if not set(text.split(",")) <= set(FAULTS):
        raise ValueError(text)
    return text.split(",")


def _rounds(text: str) -> int:
    rounds = int(text)
    if not 1 <= rounds <= 20:
        raise ValueError(text)
    return rounds


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",")]
    if not levels or min(levels) < 1:
        raise ValueError(text)
    return levels


def _names(text: str) -> list[str]:
    known = {"dynamod": "dynamod", "supervisord": "supervisord", "none": PlainRun.name}
    if not set(text.split(",")) <= set(known):
        raise ValueError(text)
    return [known[x] for x in text.split(",")]


def run_all(args: Any, work: Path) -> list[dict[str, Any]]:
    quick = args.quick
    runs, levels, faults = plan(args)
    seconds, fault_at = (QUICK_RUN_S, QUICK_FAULT_AT_S) if quick else (RUN_S, FAULT_AT_S)
    results: list[dict[str, Any]] = []
    stacks = Stacks()
    try:
        for turn in range(1 if quick else args.rounds):
            for cls in runs:
                for c in levels:
                    got = one_supervisor(stacks, cls, c, seconds, fault_at, faults, work, quick)
                    results += [{**r, "round": turn + 1} for r in got]
    finally:
        stacks.close()
    for r in results:
        r["stack_restarts"] = stacks.restarts.get(r["supervisor"], 0)
    return results


def one_supervisor(
    stacks: Stacks,
    cls: type[Variant],
    concurrency: int,
    seconds: float,
    fault_at: float,
    faults: list[str],
    work: Path,
    quick: bool,
) -> list[dict[str, Any]]:
    """The fault-free run (full profile), then each fault, on `cls`'s stack."""
    out: list[dict[str, Any]] = []
    reference: dict[str, Any] | None = None
    if not quick:
        run = stacks.get(cls)
        load = load_for(run, concurrency, seconds)
        records, summary, _ = drive(run, load, None, 0, work)
        reference = {**measured(run.name, load, records, summary, None), "fault": "none"}
        reference["goodput_windows"] = windows(records, reference, quick)
        reference["noise_recovery_s"] = noise_floor(records, reference)
        out.append(reference)
    for fault in faults:
        if fault == "push" and cls is not DynamodRun:
            continue
        run = stacks.get(cls)
        load = load_for(run, concurrency, seconds)
        records, summary, injector = drive(run, load, fault, fault_at, work)
        result = {**measured(run.name, load, records, summary, injector), "fault": fault}
        if reference is None:
            fault_t = result["start"] + result.get("fault_at_s", float("nan"))
            result["reference"] = before_fault(records, fault_t)
        else:
            result["reference"] = {k: reference[k] for k in REFERENCE_KEYS}
            result["no_fault_recovery_s"] = reference["noise_recovery_s"]
        recovery(result, records, quick)
        result["goodput_windows"] = windows(records, result, quick)
        result["served_after"] = serving(run, 90)
        out.append(result)
    return out


REFERENCE_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "goodput_rps")


def load_for(run: Variant, concurrency: int, seconds: float) -> Load:
    return Load(
        url=run.url, model=MODEL, concurrency=concurrency, seconds=seconds,
        ttft_slo_ms=TTFT_SLO_MS, itl_slo_ms=ITL_SLO_MS,
    )  # fmt: skip


# --------------------------------------------------------------------------- the report

HEADERS = [
    "supervisor", "concurrency", "requests", "failed", "of them in flight at the fault",
    "failing until (s after fault)", "TTFT p50 ms", "TTFT p99 ms",
    "ITL p50 ms", "ITL p99 ms", "goodput req/s", "goodput / fault-free",
    "TTFT p99 / fault-free", "s to 95 % goodput",
    "s to 95 % in the fault-free run (its noise)", "serving after",
]  # fmt: skip


FREE = [h for h in HEADERS[:11] if "fault" not in h]


def row(r: dict[str, Any]) -> list[Any]:
    ref = r.get("reference") or {}

    def ratio(key: str) -> float:
        base = ref.get(key, float("nan"))
        return r[key] / base if base else float("nan")

    back = r.get("recovery_s")
    return [
        r["supervisor"], r["concurrency"], r["records"], r["failed"],
        r.get("failed_in_flight", "-"), r.get("failing_until_s", "-"),
        r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"],
        r["goodput_rps"], ratio("goodput_rps"), ratio("ttft_p99_ms"),
        "never" if back is None and "fault_at_s" in r else back,
        noise(r), r.get("served_after", True),
    ]  # fmt: skip


def noise(r: dict[str, Any]) -> Any:
    """The fault-free run's own "s to 95 %" ("-" without one: the quick profile)."""
    if "no_fault_recovery_s" not in r:
        return "-"
    return "never" if r["no_fault_recovery_s"] is None else r["no_fault_recovery_s"]


def tables(report: Report, results: list[dict[str, Any]], quick: bool) -> None:
    seconds, fault_at = (QUICK_RUN_S, QUICK_FAULT_AT_S) if quick else (RUN_S, FAULT_AT_S)
    base = [r for r in results if r["fault"] == "none"]
    if base:
        ref = Table(f"Fault-free, {seconds:g} s of AIPerf load", FREE, digits=1)
        ref.rows = [[x for x, h in zip(row(r), HEADERS, strict=True) if h in FREE] for r in base]
        report.tables.append(ref)
    if any(r.get("round", 1) > 1 for r in base):
        report.tables.append(rounds_table(base))
    for fault, label in FAULTS.items():
        rows = [row(r) for r in results if r["fault"] == fault]
        if rows:
            title = f"{label}, {fault_at:g} s into {seconds:g} s of AIPerf load"
            report.tables.append(Table(title, HEADERS, rows, digits=1))
    report.tables.append(host_table(results))


def host_table(results: list[dict[str, Any]]) -> Table:
    """The host while each run sent (bench/host.py): a run slower than its neighbours with
    more CPU stolen or more pages read back in was slowed by the machine, not the fault."""
    table = Table(
        "The host while each run sent: busy, stolen and kdamond's CPU, pages read back in",
        ["supervisor", "fault", "concurrency", *host.COLUMNS],
        digits=2,
    )  # fmt: skip
    for r in results:
        h = r.get("host")
        if isinstance(h, dict):
            table.rows.append([r["supervisor"], r["fault"], r["concurrency"], *host.cells(h)])
    return table


def rounds_table(base: list[dict[str, Any]]) -> Table:
    """Each supervisor's fault-free goodput, round by round, against no supervisor's in the
    same round (their runs minutes apart, not a whole supervisor's runs apart)."""
    table = Table(
        "Fault-free goodput over the rounds, the supervisors taking turns in each: the "
        "supervisor's own cost, side by side",
        ["supervisor", "concurrency", "goodput req/s, round by round", "median",
         "/ no supervisor's in the same round (median)", "TTFT p50 ms (median)",
         "ITL p50 ms (median)"],
        digits=2,
    )  # fmt: skip
    plain = {(r["concurrency"], r["round"]): r["goodput_rps"] for r in base
             if r["supervisor"] == PlainRun.name}  # fmt: skip
    for name in dict.fromkeys(r["supervisor"] for r in base):
        for c in sorted({r["concurrency"] for r in base if r["supervisor"] == name}):
            mine = [r for r in base if r["supervisor"] == name and r["concurrency"] == c]
            ratios = [r["goodput_rps"] / plain[(c, r["round"])] for r in mine
                      if plain.get((c, r["round"]))]  # fmt: skip
            table.rows.append([
                name, c, " / ".join(f"{r['goodput_rps']:.1f}" for r in mine),
                statistics.median(r["goodput_rps"] for r in mine),
                statistics.median(ratios) if ratios else None,
                statistics.median(r["ttft_p50_ms"] for r in mine),
                statistics.median(r["itl_p50_ms"] for r in mine),
            ])  # fmt: skip
    return table


def notes(report: Report, results: list[dict[str, Any]], quick: bool) -> None:
    report.notes += [
        f"goodput SLOs (AIPerf --goodput): time_to_first_token {TTFT_SLO_MS:g} ms, "
        f"inter_token_latency {ITL_SLO_MS:g} ms; 2 CPU workers, frontend --migration-limit "
        f"{MIGRATION_LIMIT}.",
        "s to 95 % goodput: the start of the first window (3 s; 2 s quick) after the fault's "
        "first window below 95 % of the run's own goodput before the fault that is back at "
        "95 %; 0 if none fell below; never: not back before the run's end. goodput / "
        "fault-free and TTFT p99 / fault-free: against the separate fault-free run.",
        "s to 95 % in the fault-free run: the same judgment on the fault-free run, its fault "
        f"time {FAULT_AT_S:g} s: a dip of the machine's own anywhere after that time counts, "
        "so a fault's figure near this one is noise, not the fault's cost.",
    ]
    if quick:
        report.notes.append(
            "quick: the fault-free reference is the run's own requests that ended before the "
            "fault (no separate fault-free run)."
        )
    for r in results:
        if r.get("fault_error") or r.get("push_failures") or r.get("errors"):
            report.notes.append(
                f"{r['supervisor']}, {r['fault']}, c{r['concurrency']}: "
                f"{r.get('fault_error') or ''} {r.get('push_failures') or ''} "
                f"errors {r.get('errors')}"[:400]
            )


@entry
def main() -> None:
    args = parse_args()
    why = aiperf_run.missing()
    if why:
        print(f"{program()}: {why}", file=sys.stderr, flush=True)
        sys.exit(2)
    bench_mark()
    report = Report("goodput", "17. Goodput under faults, measured by AIPerf", args.quick)
    try:
        with state_dir("gp") as work:
            aiperf_run.hf_cache(prebuilt_model(), work / "hf")
            results = run_all(args, work)
    finally:
        sweep()
    tables(report, results, args.quick)
    notes(report, results, args.quick)
    report.data = {"runs": results, "slo_ms": {"ttft": TTFT_SLO_MS, "itl": ITL_SLO_MS}}
    if args.png is not None:
        drawn = goodput_plot.draw(results, args.png, FAULTS)
        report.notes.append("pictures: " + ", ".join(str(p) for p in drawn))
    emit(report, args.json)


if __name__ == "__main__":
    main()
