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

TTFT again through raw sockets, two kept-alive connections taking turns request by request:
one reading plainly, one setting TCP_QUICKACK before each read (its ACKs go out at once
instead of after Linux's delayed-ACK timer, up to 40 ms). The frontend writes the response
head and the first event separately and its connections have Nagle's algorithm on
(Dynamo's HTTP service sets no TCP_NODELAY): the event waits for the ACK of the head.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
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


def raw_request(sock: socket.socket, instance: int | None, prompt_ids: list[int],
                quickack: bool, max_tokens: int = 1) -> tuple[float, int]:
    """One streamed completion over a kept-alive raw connection: its TTFT ms (until the
    first event with `choices`) and how many reads brought events (1: the whole stream
    arrived at once)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True}  # fmt: skip
    if instance is not None:
        body["nvext"] = {"backend_instance_id": instance}
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")  # fmt: skip
    started = time.monotonic()
    sock.sendall(head.encode() + data)
    seen, first, arrivals = b"", None, 0
    while b"data: [DONE]" not in seen:
        if quickack:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the frontend closed the connection mid-stream")
        arrivals += b'"choices"' in chunk
        seen += chunk
        if first is None and b'"choices"' in seen:
            first = (time.monotonic() - started) * 1000
        if b" 200 OK" not in seen[:64] and b"\r\n\r\n" in seen:
            raise RuntimeError(f"frontend answered {seen[:200]!r}")
    if first is None:
        raise RuntimeError("no event with choices in the stream")
    return first, arrivals


def raw_ttfts(port: int, instance: int | None, runs: int, streams: int,
              max_tokens: int) -> dict[str, dict[str, list[float]]]:
    """Through two kept-alive raw connections taking turns (plain, quickack): the TTFT ms
    of `runs` one-token requests, and the reads that brought events in each of `streams`
    streams of `max_tokens` tokens."""
    out: dict[str, dict[str, list[float]]] = {
        kind: {"ttft": [], "arrivals": []} for kind in ("plain", "quickack")
    }
    with socket.create_connection(("127.0.0.1", port), timeout=30) as plain, \
            socket.create_connection(("127.0.0.1", port), timeout=30) as quick:  # fmt: skip
        pair = (("plain", plain, False), ("quickack", quick, True))
        for _, sock, ack in pair:  # warm both
            raw_request(sock, instance, prompt(32, 90_000 + int(ack)), ack)
        for i in range(runs):
            for kind, sock, ack in pair:
                salt = 60_000 + 2 * i + int(ack)
                out[kind]["ttft"].append(raw_request(sock, instance, prompt(32, salt), ack)[0])
        for i in range(streams):
            for kind, sock, ack in pair:
                salt = 80_000 + 2 * i + int(ack)
                _, arrivals = raw_request(sock, instance, prompt(32, salt), ack, max_tokens)
                out[kind]["arrivals"].append(arrivals)
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
                    raw = raw_ttfts(port, int(instance), 10 if args.quick else 40,
                                    3 if args.quick else 10, 32 if args.quick else 64)
                    results[engine]["raw"] = {
                        kind: {"ttft_ms": summary(v["ttft"]), "arrivals": summary(v["arrivals"])}
                        for kind, v in raw.items()
                    }
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
    acks = Table(
        "Through kept-alive raw connections taking turns, the client's ACKs delayed (Linux's "
        "default) or sent at once (TCP_QUICKACK): TTFT ms, and the reads that brought a "
        "stream's events (1: the whole stream at once)",
        ["engine", "TTFT p50 plain", "TTFT p95 plain", "TTFT p50 quickack",
         "TTFT p95 quickack", "plain / quickack", "reads with events, median: plain",
         "quickack", "tokens a stream"],
    )
    for engine, r in results.items():
        plain, quick = r["raw"]["plain"], r["raw"]["quickack"]
        acks.rows.append([engine, plain["ttft_ms"]["median"], plain["ttft_ms"]["p95"],
                          quick["ttft_ms"]["median"], quick["ttft_ms"]["p95"],
                          ratio(plain["ttft_ms"]["median"], quick["ttft_ms"]["median"]),
                          plain["arrivals"]["median"], quick["arrivals"]["median"],
                          32 if args.quick else 64])  # fmt: skip
    report.tables.append(acks)
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
