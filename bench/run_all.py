"""Run every benchmark with the same flags and collect the results.

    python -m bench.run_all [--quick] [--json] [--only NAME,...] [--save DIR]

Each benchmark runs as its own process (`python -m bench.NAME [--quick] --json`), one after
the other, cheapest first; a benchmark that crashes is reported and the rest still run
(exit status 1 at the end, one line on stderr naming each failed benchmark and its own
one-line failure). Missed targets are results, not errors. `--save DIR` writes
each benchmark's JSON and a combined results.md there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import (
    entry,
    machine,
    options,
    program,
    render_json,
)

# Every benchmark in bench/, cheapest first. Adding one is this one line: `python -m
# bench.run_all` runs it and CI runs its --quick profile (tests/integration/test_bench_smoke.py
# takes its names from here; tests/unit/test_bench_entry.py fails for a bench/ module that
# builds a Report and is missing here).
BENCHMARKS = [
    "etcd_client",
    "output",
    "overhead",
    "detect",
    "down",
    "cold_up",
    "worker_start",
    "tokens",
    "policy_push",
    "recovery",
    "spare_kills",
    "load_kill",
    "goodput",
    "outages",
    "cluster",
    "fleet",
    "verl_checkpoint",
    "publish_scale",
    "publish_nodes",
    "real_engine",
    "shm_note",
]


def run_one(name: str, quick: bool) -> tuple[dict[str, Any] | None, str]:
    """(its JSON result, "") or (None, what failed: its exit status and last stderr line)."""
    cmd = [sys.executable, "-m", f"bench.{name}", "--json"]
    cmd += ["--quick"] if quick else []
    print(f"# running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "(nothing on stderr)"
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {last}"
    try:
        return json.loads(proc.stdout), ""
    except ValueError:
        return None, f"exit 0 but no JSON result on stdout; stderr: {last}"


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--save", type=Path, default=None, help="directory for the results")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or BENCHMARKS
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {BENCHMARKS}")
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    started = time.time()
    for name in names:
        result, why = run_one(name, args.quick)
        if result is None:
            failed[name] = why
            print(f"# bench.{name} failed ({why})", file=sys.stderr, flush=True)
            continue
        results.append(result)
        if args.save:
            (args.save / f"{name}.json").write_text(json.dumps(result, indent=1))
        if not args.json:
            print(render_json(result) + "\n", flush=True)
    summary = {
        "quick": args.quick,
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "benchmarks": results,
        "failed": sorted(failed),
        "targets": [{"benchmark": r["benchmark"], **t} for r in results for t in r["targets"]],
    }
    if args.save:
        text = "\n\n".join(render_json(r) for r in results)
        (args.save / "results.md").write_text(text + "\n")
        (args.save / "all.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print("## Targets")
        for t in summary["targets"]:
            print(
                f"- [{'met' if t['met'] else 'MISSED'}] {t['benchmark']}: {t['target']}: "
                f"{t['measured']:.3g} {t['unit']} (limit {t['limit']:g} {t['unit']})"
            )
    sys.stdout.flush()
    if failed:
        print(
            f"{program()}: failed: {len(failed)} of {len(names)} benchmarks: "
            + "; ".join(f"{name} ({why})" for name, why in failed.items()),
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
