"""AIPerf (PyPI `aiperf`, the tool Dynamo's docs benchmark with) for bench.goodput: its
venv, its command line, and what it exports (per-request records, the summary), read
from its files, never from its console.

`make install-aiperf` installs it into .venv-aiperf (scripts/install-aiperf.sh). It runs
offline: HF_HUB_OFFLINE=1, and the served model's own tokenizer files laid out as a
Hugging Face cache (aiperf 0.13.0 resolves even a local path through the hub's cache when
offline, so a plain directory is refused; a hub lookup fails loudly instead of
downloading)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import ROOT

VENV = ROOT / ".venv-aiperf"
AIPERF = VENV / "bin" / "aiperf"
MAKE_TARGET = "make install-aiperf"
# The name aiperf knows the tokenizer by, inside the cache dir hf_cache() writes.
TOKENIZER = "dynamod/tiny-cpu"
RECORDS = "profile_export.jsonl"
SUMMARY = "profile_export_aiperf.json"


class AiperfError(Exception):
    """aiperf's output is missing or not what this module reads (names the file)."""


def missing() -> str | None:
    """Why aiperf cannot run here (one line), or None."""
    if os.access(AIPERF, os.X_OK):
        return None
    return f"{AIPERF.relative_to(ROOT)} not found: run `{MAKE_TARGET}` first"


def hf_cache(model_dir: Path, root: Path) -> Path:
    """The model's tokenizer files as a Hugging Face hub cache under `root` (symlinks);
    returns the cache dir (HF_HUB_CACHE). aiperf then loads TOKENIZER from it offline."""
    repo = root / f"models--{TOKENIZER.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for src in model_dir.glob("*.json"):
        link = snapshot / src.name
        if not link.exists():
            link.symlink_to(src)
    return root


@dataclass(frozen=True)
class Load:
    """One aiperf run: streaming chat at `concurrency` for `seconds`."""

    url: str
    model: str
    concurrency: int
    seconds: float
    isl: int = 32
    osl: int = 32
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 50.0
    request_timeout_s: float = 15.0
    grace_s: float = 15.0
    seed: int = 1

    @property
    def goodput(self) -> str:
        return f"time_to_first_token:{self.ttft_slo_ms:g} inter_token_latency:{self.itl_slo_ms:g}"


def command(load: Load, artifacts: Path) -> list[str]:
    """`aiperf profile` for `load`: synthetic prompts drawn from the tokenizer's vocabulary
    (no text corpus to tokenize at start), exactly isl tokens in and osl out (ignore_eos,
    counted by the server's usage), per-request records exported."""
    return [
        str(AIPERF), "profile",
        "--model", load.model,
        "--url", load.url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", TOKENIZER,
        "--prompt-corpus", "random",
        "--isl", str(load.isl), "--isl-stddev", "0",
        "--osl", str(load.osl), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--use-server-token-count",
        "--concurrency", str(load.concurrency),
        "--benchmark-duration", f"{load.seconds:g}",
        "--benchmark-grace-period", f"{load.grace_s:g}",
        "--request-timeout-seconds", f"{load.request_timeout_s:g}",
        "--goodput", load.goodput,
        "--random-seed", str(load.seed),
        "--export-level", "records",
        "--artifact-dir", str(artifacts),
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--workers-max", "1",
        "--record-processors", "1",
    ]  # fmt: skip


def environment(cache: Path) -> dict[str, str]:
    """Our environment for aiperf: offline against `cache`; bytecode written (the venv is
    installed without it; the first run compiles what aiperf imports, once)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(cache))
    env.pop("PYTHONPATH", None)  # aiperf's venv, not ours
    return env


# --------------------------------------------------------------------------- its exports


@dataclass(frozen=True)
class Record:
    """One request as aiperf exported it: wall-clock seconds, and what came of it."""

    start: float
    end: float
    error: str  # "" when it succeeded
    good: bool  # met every goodput SLO
    ttft_ms: float
    itl_ms: float

    @property
    def ok(self) -> bool:
        return not self.error


def _metric(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name, {}).get("value")
    return float(value) if isinstance(value, int | float) else math.nan


def record(line: dict[str, Any]) -> Record:
    meta, metrics = line["metadata"], line.get("metrics") or {}
    error = line.get("error")
    start = meta["request_start_ns"] / 1e9
    end_ns = meta.get("request_end_ns")
    return Record(
        start=start,
        end=end_ns / 1e9 if end_ns else start,
        error=f"{error.get('type') or ''}: {error.get('message', '')}"[:200] if error else "",
        good=not error and _metric(metrics, "good_request_count") == 1,
        ttft_ms=_metric(metrics, "time_to_first_token"),
        itl_ms=_metric(metrics, "inter_token_latency"),
    )


def read_records(path: Path) -> list[Record]:
    """profile_export.jsonl (--export-level records), by start time."""
    if not path.is_file():
        raise AiperfError(f"{path}: aiperf wrote no per-request records")
    found = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            found.append(record(json.loads(text)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AiperfError(f"{path}:{n}: not an aiperf record ({exc!r})") from None
    return sorted(found, key=lambda r: r.start)


SUMMARY_METRICS = {
    "ttft_p50_ms": ("time_to_first_token", "p50"),
    "ttft_p99_ms": ("time_to_first_token", "p99"),
    "itl_p50_ms": ("inter_token_latency", "p50"),
    "itl_p99_ms": ("inter_token_latency", "p99"),
    "goodput_rps": ("goodput", "avg"),
    "throughput_rps": ("request_throughput", "avg"),
    "requests": ("request_count", "avg"),  # the requests that succeeded
    "duration_s": ("benchmark_duration", "avg"),
}


def read_summary(path: Path) -> dict[str, float]:
    """The figures bench.goodput reports from profile_export_aiperf.json (NaN where aiperf
    computed none, e.g. no request succeeded); aiperf_errors counted from its error summary."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AiperfError(f"{path}: no aiperf summary ({exc})") from None
    if not isinstance(data, dict) or "aiperf_version" not in data:
        raise AiperfError(f"{path}: not an aiperf summary (no aiperf_version)")
    out: dict[str, float] = {}
    for key, (metric, stat) in SUMMARY_METRICS.items():
        value = (data.get(metric) or {}).get(stat)
        out[key] = float(value) if isinstance(value, int | float) else math.nan
    if math.isnan(out["requests"]):  # no request succeeded
        out["requests"] = 0.0
    errors = data.get("error_summary") or []
    out["aiperf_errors"] = float(sum(int(e.get("count", 0)) for e in errors))
    return out


# --------------------------------------------------------------------------- recovery


def good_rate(records: list[Record], start: float, end: float) -> float:
    """Good requests completed in [start, end), per second."""
    if end <= start:
        return math.nan
    return sum(1 for r in records if r.good and start <= r.end < end) / (end - start)


def good_series(
    records: list[Record], start: float, end: float, window: float, step: float = 1.0
) -> list[float]:
    """Goodput (good req/s) in windows of `window` s starting every `step` s from `start`
    while a whole window fits before `end`: the windows recovery_s judges, for a picture."""
    out = []
    s = start
    while s + window <= end + 1e-9:
        out.append(good_rate(records, s, s + window))
        s += step
    return out


def recovery_s(
    records: list[Record],
    fault: float,
    run_end: float,
    baseline: float,
    *,
    window: float = 3.0,
    step: float = 0.25,
    share: float = 0.95,
) -> float | None:
    """Seconds from the fault until goodput is back to `share` of `baseline` (good req/s):
    windows of `window` s starting at the fault, every `step` s, each the good requests
    completed in it. 0.0 if no window after the fault fell below; else the start of the
    first window back at `share` after the first one below. None ("never") if goodput was
    not back before the run's end (`run_end`: when aiperf stopped sending)."""
    if not baseline > 0:
        raise ValueError(f"baseline goodput must be positive, got {baseline!r}")
    threshold = share * baseline
    starts = []
    s = fault
    while s + window <= run_end + 1e-9:
        starts.append(s)
        s += step
    below = [good_rate(records, s, s + window) < threshold for s in starts]
    if True not in below:
        return 0.0 if starts else None
    first = below.index(True)
    for s, low in zip(starts[first:], below[first:], strict=True):
        if not low:
            return s - fault
    return None
