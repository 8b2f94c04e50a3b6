"""Benchmark 4 - cold start to fully ready: every shard routable (the frontend's /health
lists N generate instances and /v1/models lists the model).

    python -m bench.cold_up [--quick] [--json] [--workers N]

Each run starts the local stack (serve-only, see bench.common.serve_stack) from a fresh
state dir (the tiny model already built in the shared cache, for every variant), then
ends it:
- dynamod: `dynamod up STACK --detach` until it returns 0 (every unit ready: readiness
  gated, shards admitted). Also when the daemon logged stack.ready, and when an outside
  poller (every 20 ms) first saw the stack routable.
- supervisord: the exported config, everything started at once without readiness gating;
  time until the outside poller sees the stack routable.
- sequential recipe: a plain script starts one unit at a time and polls it before the next:
  etcd and NATS health every 0.5 s, the model build until it exits (0.5 s), each worker's
  /health and then the frontend every 2 s (today's recipe).
- critical path: from the dynamod run's own log, the longest dependency chain of units'
  spawn -> ready times (the frontend's part is spawn -> its first /health 200, seen by the
  outside poller), i.e. what a perfect gated start could not beat.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from typing import Any

from bench.procs import (
    bench_mark,
    started_at,
    state_dir,
    sweep,
)
from bench.report import (
    Report,
    Table,
    emit,
    entry,
    options,
    ratio,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)
from bench.stack import (
    MODEL,
    NAMESPACE,
    PlainStack,
    load_local_stack,
    prebuilt_model,
    routable,
    serve_stack,
)


class Watcher(threading.Thread):
    """Polls a frontend every 20 ms: first /health 200 and first fully routable moment."""

    def __init__(self, url_of: Any, workers: int, started: float, timeout: float = 180) -> None:
        super().__init__(daemon=True)
        self.url_of, self.workers, self.started, self.timeout = url_of, workers, started, timeout
        self.first_health: float | None = None
        self.routable: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        import aiohttp

        url = None
        async with aiohttp.ClientSession() as session:
            while not self.stop.is_set() and time.monotonic() - self.started < self.timeout:
                if url is None:
                    url = self.url_of()
                if url is not None:
                    if self.first_health is None:
                        try:
                            async with session.get(
                                f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)
                            ) as resp:
                                if resp.status == 200:
                                    self.first_health = time.monotonic() - self.started
                        except (TimeoutError, aiohttp.ClientError):
                            pass
                    if self.first_health is not None and await routable(session, url, self.workers):
                        self.routable = time.monotonic() - self.started
                        return
                await asyncio.sleep(0.02)


def http_ok(url: str, expect: dict[str, Any] | None, method: str = "GET") -> bool:
    try:
        request = urllib.request.Request(url, method=method)
        with urllib.request.urlopen(request, timeout=1) as resp:
            if resp.status != 200:
                return False
            if expect:
                body = json.loads(resp.read())
                return all(body.get(k) == v for k, v in expect.items())
            return True
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- variants


def run_dynamod(workers: int) -> dict[str, Any]:
    with state_dir("cu") as state:
        prebuilt_model()
        dm = Dynamod(state)

        def url_of() -> str | None:
            try:
                front = dm.unit("frontend")
            except Exception:
                return None
            return f"http://127.0.0.1:{front['ports']['http']}"

        try:
            t0_epoch, started = time.time(), time.monotonic()
            watcher = Watcher(url_of, workers, started)
            watcher.start()
            up_s = dm.up(serve_stack(state), f"workers={workers}", timeout=180)
            daemon_started = started_at(dm.status()["daemon_pid"]) - t0_epoch
            watcher.join(30)
            events = dm.events()
        finally:
            dm.close()
    return {
        "up_s": up_s,
        "routable_s": watcher.routable,
        "first_health_s": watcher.first_health,
        "daemon_started_s": daemon_started,
        **from_log(events, t0_epoch, watcher.first_health),
    }


def from_log(
    events: list[dict[str, Any]], t0: float, frontend_health: float | None
) -> dict[str, Any]:
    """stack.ready, each unit's spawn -> ready, and the critical path."""
    spawn: dict[str, float] = {}
    ready: dict[str, float] = {}
    stack_ready = None
    for e in events:
        if e.get("event") == "stack.ready":
            stack_ready = e["t"] - t0
        if e.get("event") != "unit.state":
            continue
        if e["new"] == "starting" and e["unit"] not in spawn:
            spawn[e["unit"]] = e["t"] - t0
        if e["new"] in {"ready", "completed"} and e["unit"] not in ready:
            ready[e["unit"]] = e["t"] - t0
    took = {u: ready[u] - spawn[u] for u in ready if u in spawn}
    infra = max(took.get("etcd", 0.0), took.get("nats", 0.0))
    before_workers = max(infra, took.get("model", 0.0))
    worker_chain = max(
        (before_workers + d for u, d in took.items() if u.startswith("worker@")), default=0.0
    )
    frontend_chain = (
        infra + frontend_health - spawn["frontend"]
        if frontend_health is not None and "frontend" in spawn
        else 0.0
    )
    first_spawn = min(spawn.values()) if spawn else 0.0
    frontend_boot = (
        frontend_health - spawn["frontend"]
        if frontend_health is not None and "frontend" in spawn
        else None
    )
    return {
        "frontend_boot_s": frontend_boot,
        "ready_to_stack_ready_s": (
            stack_ready - max(ready.values()) if stack_ready is not None and ready else None
        ),
        "stack_ready_s": stack_ready,
        "unit_ready_s": took,
        "first_spawn_s": first_spawn,
        "critical_path_s": max(worker_chain, frontend_chain),
        "critical_chain": "etcd/nats/model -> worker"
        if worker_chain >= frontend_chain
        else "etcd/nats -> frontend boot",
    }


PORT = re.compile(r"--http-port (\d+)")


def run_supervisord(workers: int) -> dict[str, Any]:
    with state_dir("scu") as state:
        prebuilt_model()
        sd = Supervisord(state, serve_stack(state), f"workers={workers}")
        url = f"http://127.0.0.1:{PORT.search(sd.config_text()).group(1)}"  # type: ignore[union-attr]
        try:
            started = sd.start()
            watcher = Watcher(lambda: url, workers, started)
            watcher.run()
        finally:
            sd.close()
            sweep()
    return {"routable_s": watcher.routable, "first_health_s": watcher.first_health}


def run_sequential(
    workers: int, infra_poll: float = 0.5, dynamo_poll: float = 2.0
) -> dict[str, Any]:
    with state_dir("qcu") as state:
        prebuilt_model()
        stack = load_local_stack(state, f"workers={workers}")
        plain = PlainStack(stack)
        try:
            started = time.monotonic()
            for name in stack.order:
                spec = stack.units[name]
                proc = plain.spawn(name)
                interval = dynamo_poll if name.startswith(("worker", "frontend")) else infra_poll
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    time.sleep(interval)
                    if spec.type == "oneshot":
                        if proc.poll() is not None:
                            break
                    elif name == "frontend":
                        url = spec.ready.url
                        if asyncio.run(_routable_once(url, workers)):
                            break
                    elif http_ok(spec.ready.url, spec.ready.expect_json):
                        break
                else:
                    raise TimeoutError(f"sequential start: {name} not ready")
            routable_s = time.monotonic() - started
        finally:
            plain.close()
            sweep()
    return {"routable_s": routable_s, "order": list(stack.order)}


async def _routable_once(url: str, workers: int) -> bool:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await routable(session, url, workers)


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    bench_mark()
    reps = 1 if args.quick else 7
    report = Report("cold_up", f"4. Cold start to fully ready ({args.workers} shards)", args.quick)
    runs: dict[str, list[dict[str, Any]]] = {"dynamod": [], "supervisord": [], "sequential": []}
    try:
        for _ in range(reps):
            runs["dynamod"].append(run_dynamod(args.workers))
            runs["supervisord"].append(run_supervisord(args.workers))
            runs["sequential"].append(run_sequential(args.workers))
    finally:
        sweep()
    dyn, sup, seq = runs["dynamod"], runs["supervisord"], runs["sequential"]
    d_up = summary(r["up_s"] for r in dyn)
    d_ready = summary(r["stack_ready_s"] for r in dyn)
    d_route = summary(r["routable_s"] for r in dyn)
    crit = summary(r["critical_path_s"] for r in dyn)
    s_route = summary(r["routable_s"] for r in sup)
    q_route = summary(r["routable_s"] for r in seq)
    base = s_route["median"]
    table = Table(
        f"Seconds from start to fully ready, {reps} run(s) each",
        ["variant", "gated on readiness", "median", "p95", "vs supervisord"],
        digits=2,
    )
    table.rows += [
        [
            "dynamod: `up --detach` returned",
            True,
            d_up["median"],
            d_up["p95"],
            ratio(d_up["median"], base),
        ],
        [
            "dynamod: daemon logged stack.ready",
            True,
            d_ready["median"],
            d_ready["p95"],
            ratio(d_ready["median"], base),
        ],
        [
            "dynamod: outside poller saw it routable",
            True,
            d_route["median"],
            d_route["p95"],
            ratio(d_route["median"], base),
        ],
        [
            "supervisord, all at once (outside poller)",
            False,
            s_route["median"],
            s_route["p95"],
            1.0,
        ],
        [
            "sequential recipe, 0.5 s / 2 s polls",
            True,
            q_route["median"],
            q_route["p95"],
            ratio(q_route["median"], base),
        ],
        [
            "critical path (longest chain of unit ready times)",
            "-",
            crit["median"],
            crit["p95"],
            ratio(crit["median"], base),
        ],
    ]
    report.tables.append(table)
    units = Table(
        "dynamod run: each unit's spawn -> ready, seconds (median)",
        ["unit", "spawn -> ready"],
        digits=2,
    )
    names = sorted({u for r in dyn for u in r["unit_ready_s"]})
    for name in names:
        units.rows.append([name, summary(r["unit_ready_s"].get(name) for r in dyn)["median"]])
    units.rows.append(
        [
            "frontend: spawn -> first /health 200 (outside poller)",
            summary(r["frontend_boot_s"] for r in dyn)["median"],
        ]
    )
    units.rows.append(
        [
            "(CLI) `up` invoked -> daemon process started (10 ms steps)",
            summary(r["daemon_started_s"] for r in dyn)["median"],
        ]
    )
    units.rows.append(
        [
            "(daemon) process started -> first unit spawned",
            summary(r["first_spawn_s"] - r["daemon_started_s"] for r in dyn)["median"],
        ]
    )
    units.rows.append(
        [
            "(daemon) last unit ready -> stack.ready logged",
            summary(r["ready_to_stack_ready_s"] for r in dyn)["median"],
        ]
    )
    units.rows.append(
        [
            "(CLI) stack.ready -> `up --detach` returned",
            summary(r["up_s"] - r["stack_ready_s"] for r in dyn)["median"],
        ]
    )
    report.tables.append(units)
    report.target("dynamod `up` / supervisord ungated start", ratio(d_up["median"], base), 1.2, "x")
    report.data = {"runs": runs, "workers": args.workers, "model": MODEL, "namespace": NAMESPACE}
    report.notes += [
        "the tiny model is built beforehand in dynamod's cache dir (the stock `model_dir`), "
        "so the `model` unit only checks it (building it takes ~4 s and would dominate "
        "every variant).",
        "`up --detach` returns on its first poll of the daemon after stack.ready (the "
        "daemon's own moment); the critical path needs no daemon start or polling at all.",
        f"critical chain in the dynamod runs: "
        f"{', '.join(sorted({r['critical_chain'] for r in dyn}))}.",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
