"""Run every benchmark with the same flags and collect the results.

    python -m bench.run_all [--quick] [--json] [--only NAME,...] [--save DIR]

Each benchmark runs as its own process (`python -m bench.NAME [--quick] --json`), one after
the other, cheapest first; a benchmark that crashes is reported and the rest still run
(exit status 1 at the end). Missed targets are results, not errors. `--save DIR` writes
each benchmark's JSON and a combined results.md there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import (
    machine,
    render_json,
)

BENCHMARKS = [
    "etcd_client",
    "overhead",
    "output",
    "detect",
    "down",
    "cold_up",
    "recovery",
    "policy_push",
    "load_kill",
    "outages",
    "tokens",
    "worker_start",
    "cluster",
    "verl_checkpoint",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
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
    failed: list[str] = []
    started = time.time()
    for name in names:
        cmd = [sys.executable, "-m", f"bench.{name}", "--json"]
        cmd += ["--quick"] if args.quick else []
        print(f"# running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        try:
            result = json.loads(proc.stdout)
        except ValueError:
            failed.append(name)
            print(
                f"# bench.{name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                file=sys.stderr,
                flush=True,
            )
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
        "failed": failed,
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
        if failed:
            print(f"benchmarks that crashed: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
