"""Benchmark 8 - real tokens: completion tokens/s per CPU worker at 1 and 8 concurrent
requests, and time to first token, with the numpy engine beside the mocker.

    python -m bench.tokens [--quick] [--json]

The serve-only local stack (2 workers, kv router), brought up by `dynamod up`, once with
the stock numpy engine and once with `--engine mocker` (`--var worker_engine=mocker`).
Every request is pinned to worker@0 (`nvext.backend_instance_id`), streams, ignores EOS
and asks for `max_tokens` tokens; the other worker stays idle, as on the default stack
between rollouts. tokens/s = completion tokens of all requests / wall time of the batch.
TTFT = time from sending to the first streamed chunk with a token, for a 32-token prompt,
one request at a time (each prompt fresh, so no prefix-cache hit).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from bench.procs import bench_mark, state_dir, sweep
from bench.report import Report, Table, emit, entry, options, ratio, summary
from bench.runners import Dynamod
from bench.stack import MODEL, prebuilt_model, serve_stack

ENGINES = ("numpy", "mocker")


async def stream(
    session: Any, url: str, instance: int | None, prompt: list[int], max_tokens: int
) -> Any:
    """(ttft_s, completion tokens, total_s) of one streamed completion; pinned to the worker
    `instance` unless None (one shard: the router has no choice)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if instance is not None:
        body["nvext"] = {"backend_instance_id": instance}
    started = time.monotonic()
    first = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.monotonic() - started
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    return first, tokens, time.monotonic() - started


def prompt(n: int, salt: int) -> list[int]:
    return [1, *[(salt * 31 + i * 7) % 500 + 7 for i in range(n - 1)]]


async def measure(url: str, instance: int | None, quick: bool) -> dict[str, Any]:
    import aiohttp

    max_tokens = 32 if quick else 64
    batches = 2 if quick else 5
    ttft_runs = 10 if quick else 40
    out: dict[str, Any] = {"max_tokens": max_tokens}
    async with aiohttp.ClientSession() as session:
        await stream(session, url, instance, prompt(32, 0), 4)  # warm the path
        for concurrency in (1, 8):
            rates = []
            for b in range(batches):
                t0 = time.monotonic()
                done = await asyncio.gather(
                    *(
                        stream(session, url, instance, prompt(32, 1000 * b + i + 1), max_tokens)
                        for i in range(concurrency)
                    )
                )
                rates.append(sum(d[1] for d in done) / (time.monotonic() - t0))
            out[f"tokens_per_s_{concurrency}"] = summary(rates)
        ttfts = []
        for i in range(ttft_runs):
            first, _, _ = await stream(session, url, instance, prompt(32, 50_000 + i), 1)
            ttfts.append(first * 1000)
        out["ttft_ms"] = summary(ttfts)
    return out


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    load_at_start = os.getloadavg()
    report = Report("tokens", "8. Real tokens: throughput and TTFT per CPU worker", args.quick)
    results: dict[str, dict[str, Any]] = {}
    try:
        for engine in ENGINES:
            with state_dir("tok") as state:
                prebuilt_model()
                dm = Dynamod(state)
                try:
                    dm.up(serve_stack(state), f"worker_engine={engine}", timeout=300)
                    port = dm.unit("frontend")["ports"]["http"]
                    system = dm.unit("worker@0")["ports"]["system"]
                    instance = liveness(system)["instance_id"]
                    results[engine] = asyncio.run(
                        measure(f"http://127.0.0.1:{port}", int(instance), args.quick)
                    )
                finally:
                    dm.close()
    finally:
        sweep()
    table = Table(
        "One worker, 32-token prompts, streamed (median over batches; p95 for TTFT)",
        ["engine", "tokens/s @1", "tokens/s @8", "TTFT p50 ms", "TTFT p95 ms"],
    )
    for engine, r in results.items():
        table.rows.append(
            [
                engine,
                r["tokens_per_s_1"]["median"],
                r["tokens_per_s_8"]["median"],
                r["ttft_ms"]["median"],
                r["ttft_ms"]["p95"],
            ]
        )
    if len(results) == 2:
        t, m = results["numpy"], results["mocker"]
        table.rows.append(
            [
                "numpy / mocker",
                ratio(t["tokens_per_s_1"]["median"], m["tokens_per_s_1"]["median"]),
                ratio(t["tokens_per_s_8"]["median"], m["tokens_per_s_8"]["median"]),
                ratio(t["ttft_ms"]["median"], m["ttft_ms"]["median"]),
                ratio(t["ttft_ms"]["p95"], m["ttft_ms"]["p95"]),
            ]
        )
    report.tables.append(table)
    if "numpy" in results:
        numpy_result = results["numpy"]
        report.target(
            "numpy tokens/s per worker @8",
            numpy_result["tokens_per_s_8"]["median"],
            200,
            "tok/s",
            lower_is_better=False,
        )
        ttft = numpy_result["ttft_ms"]["median"]
        report.target("numpy TTFT p50, 32-token prompt", ttft, 20, "ms")
    report.notes.append(
        "The mocker computes nothing: its TTFT is the floor of the path through the frontend "
        "and Dynamo's runtime. The numpy engine decodes all running requests in one forward "
        "pass per token; at 8 concurrent its limit is that pass (numpy on one BLAS thread, "
        "mostly per-call overhead at this size) plus one chunk per token through the runtime."
    )
    report.notes.append(
        f"load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in load_at_start)}"
        f", at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        "over 1 on this machine's cores the figures are provisional."
    )
    report.data = results
    emit(report, args.json)


def liveness(system_port: int) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{system_port}/engine/liveness_probe", data=b"{}", method="POST"
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return reply


if __name__ == "__main__":
    main()
