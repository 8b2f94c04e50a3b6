"""Benchmark 3 - client-visible failures during one `kill -9` of a shard under steady load.

    python -m bench.load_kill [--quick] [--json]

The serve-only local stack with 2 and 4 CPU workers (`--var workers=N`) takes 10
completions/s for 60 s; one worker (worker@1) is SIGKILLed a third of the way in. Every
request is counted: any answer but HTTP 200 (or no answer within 30 s) is a failure.
- dynamod: `dynamod up STACK --var workers=N --detach`.
- supervisord: the config `dynamod export supervisord` writes (autorestart).
- no supervisor: a plain script starts the same commands with the units' environment, in
  dependency order, waiting for each to answer; nothing restarts the killed worker.
Each with the stock frontend (`--migration-limit 3`: a stream from a dead worker moves to
another) and with Dynamo's default `--var migration_limit=0` (no migration), which shows
what the supervisor itself does for the clients.
Full run: one variant at a time. --quick: 2 workers, migration off, 15 s, kill at 5 s, the
three variants side by side at once (a smoke run: they share the two cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.procs import (
    bench_mark,
    sweep,
    wait_until,
)
from bench.report import (
    Report,
    Table,
    emit,
    entry,
    options,
    summary,
)
from bench.runners import (
    Dynamod,
    Supervisord,
)
from bench.stack import (
    Outcome,
    PlainStack,
    load_local_stack,
    prebuilt_model,
    serve_stack,
    wait_routable,
)

RATE = 10.0
VICTIM = "worker@1"


class Variant:
    name = ""
    url = ""

    def __init__(self, workers: int, migration_limit: int) -> None:
        self.workers = workers
        self.migration_limit = migration_limit
        self.variables = (f"workers={workers}", f"migration_limit={migration_limit}")
        self.state = Path(tempfile.mkdtemp(prefix=f"bk{self.name[:3]}-", dir="/tmp"))
        prebuilt_model()

    def up(self) -> None:
        raise NotImplementedError

    def victim_pid(self) -> int:
        raise NotImplementedError

    def after(self) -> dict[str, Any]:
        """Facts gathered after the load (e.g. whether the victim came back)."""
        return {}

    def close(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
        shutil.rmtree(self.state, ignore_errors=True)


class DynamodVariant(Variant):
    name = "dynamod"

    def up(self) -> None:
        self.dm = Dynamod(self.state)
        self.dm.up(serve_stack(self.state), *self.variables, timeout=180)
        port = self.dm.unit("frontend")["ports"]["http"]
        self.url = f"http://127.0.0.1:{port}"
        wait_routable(self.url, self.workers)

    def victim_pid(self) -> int:
        return int(self.dm.unit(VICTIM)["pid"])

    def after(self) -> dict[str, Any]:
        unit = wait_until(
            lambda: (u := self.dm.unit(VICTIM))["state"] == "ready" and u, 60, 0.1, "victim back"
        )
        return {"victim_restarts": unit["restarts"], "victim_state": unit["state"]}

    def close(self) -> None:
        self.dm.close()


PORT = re.compile(r"--http-port (\d+)")


class SupervisordVariant(Variant):
    name = "supervisord"

    def up(self) -> None:
        self.sd = Supervisord(self.state, serve_stack(self.state), *self.variables)
        self.url = f"http://127.0.0.1:{PORT.search(self.sd.config_text()).group(1)}"  # type: ignore[union-attr]
        self.sd.start()
        wait_routable(self.url, self.workers, timeout=180)

    def victim_pid(self) -> int:
        return self.sd.pid(VICTIM)

    def after(self) -> dict[str, Any]:
        info = self.sd.process_info(VICTIM)
        return {"victim_state": info["statename"]}

    def close(self) -> None:
        self.sd.close()


class PlainVariant(Variant):
    name = "no supervisor"

    def up(self) -> None:
        stack = load_local_stack(self.state, *self.variables)
        self.plain = PlainStack(stack)
        for name in stack.order:
            spec = stack.units[name]
            proc = self.plain.spawn(name)
            if spec.type == "oneshot":
                proc.wait(60)
            elif name == "frontend":
                self.url = spec.ready.url
                wait_routable(self.url, self.workers)
            else:
                wait_until(lambda url=spec.ready.url: _http_200(url), 60, 0.05, name)
        self.stack = stack

    def victim_pid(self) -> int:
        return self.plain.procs[VICTIM].pid

    def close(self) -> None:
        self.plain.close()


def _http_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


async def load_and_kill(variant: Variant, seconds: float, kill_at: float) -> dict[str, Any]:
    pid = variant.victim_pid()
    killed: list[float] = []
    scheduled: list[bool] = []

    def tick(elapsed: float) -> None:
        # The kill lands at a random phase between two sends, not right before one.
        if not scheduled and elapsed >= kill_at:
            scheduled.append(True)
            delay = random.uniform(0, 1 / RATE)

            def kill() -> None:
                os.kill(pid, signal.SIGKILL)
                killed.append(elapsed + delay)

            asyncio.get_running_loop().call_later(delay, kill)

    from bench.stack import (
        steady_load,
    )

    await steady_load(variant.url, 1.0, 3.0)  # warm-up, not counted
    outcomes: list[Outcome] = await steady_load(variant.url, RATE, seconds, on_tick=tick)
    failures = [o for o in outcomes if o.status != 200]
    kill_t = killed[0] if killed else float("nan")
    return {
        "requests": len(outcomes),
        "failures": len(failures),
        # sent before the kill and still waiting: only stream migration can save those
        "failed_in_flight": sum(1 for o in failures if o.sent_at < kill_t),
        "failed_sent_after": sum(1 for o in failures if o.sent_at >= kill_t),
        "codes": dict(Counter(o.status for o in outcomes)),
        "killed_at_s": kill_t,
        "failure_window_s": [
            min(o.sent_at for o in failures) - kill_t,
            max(o.sent_at for o in failures) - kill_t,
        ]
        if failures
        else None,
        "errors": sorted({o.error[:160] for o in failures})[:5],
        "latency_ms": summary(o.latency * 1000 for o in outcomes if o.status == 200),
    }


VARIANTS = [DynamodVariant, SupervisordVariant, PlainVariant]


def run_sequential(
    workers: int, migration: int, seconds: float, kill_at: float
) -> list[dict[str, Any]]:
    results = []
    for cls in VARIANTS:
        variant = cls(workers, migration)
        try:
            variant.up()
            result = asyncio.run(load_and_kill(variant, seconds, kill_at))
            result.update(variant.after())
        finally:
            variant.cleanup()
            sweep()
        results.append(
            {"variant": variant.name, "workers": workers, "migration_limit": migration, **result}
        )
    return results


def run_side_by_side(
    workers: int, migration: int, seconds: float, kill_at: float
) -> list[dict[str, Any]]:
    variants = [cls(workers, migration) for cls in VARIANTS]
    try:
        errors: list[BaseException] = []

        def up(v: Variant) -> None:
            try:
                v.up()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=up, args=(v,)) for v in variants]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

        async def together() -> list[dict[str, Any]]:
            return list(
                await asyncio.gather(*(load_and_kill(v, seconds, kill_at) for v in variants))
            )

        results = asyncio.run(together())
        for v, r in zip(variants, results, strict=True):
            r.update(v.after())
    finally:
        for v in variants:
            v.cleanup()
        sweep()
    return [
        {"variant": v.name, "workers": workers, "migration_limit": migration, **r}
        for v, r in zip(variants, results, strict=True)
    ]


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    if args.quick:
        counts, migrations, seconds, kill_at = [2], [0], 15.0, 5.0
    else:
        counts, migrations, seconds, kill_at = [2, 4], [3, 0], 60.0, 20.0
    report = Report(
        "load_kill", "3. Client-visible failures, one kill -9 under 10 req/s", args.quick
    )
    results: list[dict[str, Any]] = []
    try:
        for migration in migrations:
            for n in counts:
                if args.quick:
                    results += run_side_by_side(n, migration, seconds, kill_at)
                else:
                    results += run_sequential(n, migration, seconds, kill_at)
    finally:
        sweep()
    table = Table(
        f"{RATE:g} req/s for {seconds:g} s, worker@1 SIGKILLed at {kill_at:g} s",
        [
            "frontend --migration-limit",
            "shards",
            "supervisor",
            "requests",
            "failed",
            "failed %",
            "in flight at the kill",
            "sent after the kill",
            "failures from / to (s after kill)",
            "latency p50 ms",
            "p99 ms",
            "killed worker afterwards",
        ],
        digits=1,
    )
    for r in results:
        window = (
            f"{r['failure_window_s'][0]:.1f} / {r['failure_window_s'][1]:.1f}"
            if r["failure_window_s"]
            else "-"
        )
        table.rows.append(
            [
                r["migration_limit"],
                r["workers"],
                r["variant"],
                r["requests"],
                r["failures"],
                100 * r["failures"] / max(1, r["requests"]),
                r["failed_in_flight"],
                r["failed_sent_after"],
                window,
                r["latency_ms"]["median"],
                r["latency_ms"]["p99"],
                r.get("victim_state", "dead (nothing restarts it)"),
            ]
        )
    report.tables.append(table)
    for r in results:
        if r["variant"] == "dynamod":
            report.target(
                f"dynamod client-visible failures, {r['workers']} shards, "
                f"migration limit {r['migration_limit']}",
                r["failures"],
                0,
                "requests",
            )
    report.data = {"runs": results, "rate": RATE, "seconds": seconds, "kill_at_s": kill_at}
    report.notes += [
        "failure errors seen: " + "; ".join(sorted({e for r in results for e in r["errors"]}))[:600]
        if any(r["errors"] for r in results)
        else "no failed request carried an error",
        "3 s of warm-up requests at 1 req/s precede each measured window (not counted).",
    ]
    if args.quick:
        report.notes.append("quick: the three variants ran at once on the same two cores.")
    emit(report, args.json)


if __name__ == "__main__":
    main()
