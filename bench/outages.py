"""Benchmark 8 - outages: time from a fault's end to full service, and failed requests.

    python -m bench.outages [--quick] [--json]

The serve-only stack (etcd behind a cuttable TCP proxy unit named `etcd`, NATS, 2 CPU
workers, frontend, policy ledger in etcd) under steady load (8 req/s; "full service" = the
first request from which every later one succeeded). Faults, each beside today's recipe
behaviour where that comparison means something:

  etcd_cut       etcd's client port cut for 45 s, with Dynamo's lease (ETCD_LEASE_TTL) as
                 the stock units set it (300 s: nothing exits) and at Dynamo's default
                 30 s (past it: every worker and the frontend exit and start again).
                 Recipe (30 s): the units record Dynamo's exit 0 as final
                 (clean_exit_final, as `completed` did before), so nothing restarts.
  kill9_push     etcd kill -9, then a push as soon as etcd is ready: how long the push
                 waited for the router, failed / stale requests for the new version after it.
  frontend_hang  SIGSTOP of the frontend: detection, serving back, failed requests. Recipe:
                 the previous liveness (2 s interval, 2 s timeout, 3 misses).
  saturation     64 requests in flight for 30 s (5 s quick): frontend liveness misses and
                 restarts (false positives).
  daemon_kill    dynamod SIGKILLed, `up` again on the same state dir: time to ready,
                 dead instances left in etcd.
--quick runs kill9_push (after a 5 s etcd cut with the stock lease, on the same stack) once,
without the before and recipe rows (the suite's smoke run; the frontend's hang and
saturation are held to their behaviour in tests/integration/test_outages_stack.py).

--real-engine runs etcd_cut alone (stock lease), with one real `dynamo.vllm` shard
(units/worker-vllm-cpu.toml, from .venv-vllm) in the CPU workers' place, at 2 req/s (a
real shard's start takes minutes here; `make bench-outages-real-engine`; with --quick a
5 s cut). Not in CI's smoke run of the benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import bench_mark, reap_zombies, state_dir, wait_until
from bench.report import Report, Table, emit, entry, options
from bench.runners import Dynamod
from bench.stack import prebuilt_model

REPO = Path(__file__).resolve().parent.parent
PROXY = REPO / "tests" / "fixtures" / "tcpproxy.py"
CUT_S = 45.0
QUICK_CUT_S = 5.0
# Dynamo's lease in the stock units, and Dynamo 1.6.1's own default (the TTL etcd granted a
# worker's lease with ETCD_LEASE_TTL unset), which the units had before.
STOCK_LEASE_S = tomllib.loads((REPO / "units" / "worker-cpu.toml").read_text())["vars"][
    "dynamo_lease_ttl"]
OLD_LEASE_S = 30
STOCK = f"dynamod, lease {STOCK_LEASE_S} s (stock)"
MODEL = "tiny-cpu"
OLD_LIVENESS = "interval = 2\ntimeout = 2\nfailure_threshold = 3"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
REAL_UP_TIMEOUT = 3600.0  # a real shard starts in 1-10 min on a loaded 2-core machine
REAL = f"dynamod, real engine, lease {STOCK_LEASE_S} s (stock)"


def write_stack(root: Path, cut_file: Path, *, recipe_exits: bool = False,
                old_liveness: bool = False, real_engine: bool = False) -> Path:
    units = REPO / "units"
    worker = "worker-vllm-cpu.toml" if real_engine else "worker-cpu.toml"
    copies = {}
    for name in (worker, "frontend.toml"):
        text = (units / name).read_text()
        if recipe_exits:  # Dynamo's exit 0 on lease loss is final, as `completed` was
            text = re.sub(r"(\[units\.\w+\.restart\]\n)", r"\1clean_exit_final = true\n", text)
            text = text.replace('policy = "always"', 'policy = "on-failure"')
        if old_liveness and name == "frontend.toml":  # /health, 2 s x 3
            text = re.sub(r'url = "http://127.0.0.1:\{ports.http\}/live"\n'
                          r'expect_json = \{ status = "live" \}\n'
                          r"interval = 0\.25\ntimeout = 0\.5\nfailure_threshold = 2",
                          'url = "http://127.0.0.1:{ports.http}/health"\n' + OLD_LIVENESS, text)
            assert OLD_LIVENESS in text, "frontend.toml's liveness changed: update the recipe"
        copies[name] = root / name
        copies[name].write_text(text)
    path = root / "outage.toml"
    path.write_text(f"""
[stack]
name = "outage"
include = ["{units / 'nats.toml'}", "{copies[worker]}", "{copies['frontend.toml']}"]
[vars]
{'shards = 1' if real_engine else 'workers = 2'}
{f'vllm_python = "{VLLM_PYTHON}"' if real_engine else ''}
{'workers = "{vars.shards}"' if real_engine else ''}
{'frontend_ready_deadline = 3600' if real_engine else ''}
[units.etcd-server]
command = ["etcd", "--name", "dynamod", "--data-dir", "{{state_dir}}/etcd",
  "--listen-client-urls", "http://127.0.0.1:{{ports.client}}",
  "--advertise-client-urls", "http://127.0.0.1:{{ports.client}}",
  "--listen-peer-urls", "http://127.0.0.1:{{ports.peer}}",
  "--initial-advertise-peer-urls", "http://127.0.0.1:{{ports.peer}}",
  "--initial-cluster", "dynamod=http://127.0.0.1:{{ports.peer}}", "--log-level", "warn"]
ports = {{ client = 0, peer = 0 }}
restart = {{ policy = "always", give_up = false, backoff_max = 2 }}
[units.etcd-server.ready]
kind = "http"
url = "http://127.0.0.1:{{ports.client}}/health"
expect_json = {{ health = "true" }}
interval = 0.05
[units.etcd]
command = ["{{python}}", "{PROXY}", "{{ports.client}}", "{{units.etcd-server.ports.client}}",
  "--cut-file", "{cut_file}"]
ports = {{ client = 0 }}
depends_on = {{ etcd-server = "ready" }}
restart = {{ policy = "always", give_up = false, backoff_max = 1 }}
[units.etcd.ready]
kind = "http"
url = "http://127.0.0.1:{{ports.client}}/health"
expect_json = {{ health = "true" }}
interval = 0.05
[units.etcd.live]
kind = "http"
url = "http://127.0.0.1:{{ports.client}}/health"
interval = 1
timeout = 1
failure_threshold = 2
[policy]
store = "etcd"
etcd = "http://127.0.0.1:{{units.etcd.ports.client}}"
shards = ["worker"]
keep = 3
min_ready_shards = 1
""")
    return path


class Load:
    """Completions at `rate`/s in a thread (each may require a taint): (sent, status, version)."""

    def __init__(self, url: str, rate: float = 8, required: list[int | None] | None = None):
        self.url, self.rate = url, rate
        self.required = required if required is not None else [None]
        self.rows: list[tuple[float, int, int | None, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async def one(i: int) -> None:
                need = self.required[0]
                nvext: dict[str, Any] = {"extra_fields": ["engine_data"]}
                if need is not None:
                    nvext["routing_constraints"] = {"required_taints": [f"dynamod.policy/{need}"]}
                body = {"model": MODEL, "prompt": f"r{i}", "max_tokens": 4, "nvext": nvext}
                sent = time.monotonic()
                version = None
                try:
                    async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                        code, text = resp.status, await resp.text()
                    if code == 200:  # dynamo.vllm's completions carry no engine_data
                        data = (json.loads(text).get("nvext") or {}).get("engine_data") or {}
                        version = data.get("weight_version")
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                    code = -1
                self.rows.append((sent, code, need, version))

            tasks, i = [], 0
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(1 / self.rate)
            await asyncio.gather(*tasks)

    def full_service_since(self, after: float) -> float | None:
        since = None
        for sent, code, _, _ in sorted(r for r in self.rows if r[0] >= after):
            if code != 200:
                since = None
            elif since is None:
                since = sent
        return since

    def failed_after(self, after: float) -> int:
        return sum(1 for r in self.rows if r[0] >= after and r[1] != 200)


def stop(dm: Dynamod) -> None:
    if dm.running():
        dm.down()


def guarded(name: str, report: Report, run: Any, *args: Any) -> dict[str, Any] | None:
    """One scenario; a crash is a note in the report, not the end of the benchmark."""
    try:
        result: dict[str, Any] = run(*args)
        return result
    except Exception as exc:
        report.notes.append(f"{name} did not complete: {type(exc).__name__}: {exc}"[:600])
        return None


def frontend_url(dm: Dynamod) -> str:
    return f"http://127.0.0.1:{dm.unit('frontend')['ports']['http']}"


def settle(load: Load, after: float, limit: float) -> float | None:
    """Wait (up to `limit` s) until 5 s of full service; seconds from `after` to it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        since = load.full_service_since(after)
        if since is not None and time.monotonic() - since > 5:
            return since - after
        time.sleep(0.5)
    return None


def etcd_cut(lease_ttl: int | None, recipe: bool, cut_s: float,
             real_engine: bool = False) -> dict[str, Any]:
    """etcd's client port cut for `cut_s` under load, with Dynamo's lease at `lease_ttl` s
    (None: the stock units' setting); `real_engine`: one dynamo.vllm shard, 2 req/s."""
    with state_dir("oc") as state:
        cut = state / "cut"
        dm = Dynamod(state)
        try:
            lease = [f"dynamo_lease_ttl={lease_ttl}"] if lease_ttl is not None else []
            stack = write_stack(state, cut, recipe_exits=recipe, real_engine=real_engine)
            dm.up(stack, *lease, timeout=REAL_UP_TIMEOUT if real_engine else 300)
            with Load(frontend_url(dm), rate=2 if real_engine else 8) as load:
                time.sleep(3)
                result = cut_etcd(dm, load, cut, cut_s)
            result["states_after"] = {u["name"]: u["state"] for u in dm.status()["units"]}
            return result
        finally:
            stop(dm)


def cut_etcd(dm: Dynamod, load: Load, cut: Path, cut_s: float) -> dict[str, Any]:
    """Cut etcd's port for `cut_s`, heal it, wait for full service: what it cost. A Dynamo
    process exit is a worker's or the frontend's `exited`/`killed` transition from the cut
    until full service; a shard restart is a worker whose pid changed."""
    dynamo = {u["name"]: u["pid"] for u in dm.status()["units"]
              if u["name"] == "frontend" or u["name"].startswith("worker@")}
    cut_wall, cut_at = time.time(), time.monotonic()
    cut.touch()
    time.sleep(cut_s)
    cut.unlink()
    healed = time.monotonic()
    full = settle(load, healed, 60 + cut_s)
    pids = {u["name"]: u["pid"] for u in dm.status()["units"]}
    exits = [e for e in dm.transitions() if e["unit"] in dynamo and e["t"] >= cut_wall
             and str(e.get("detail", "")).startswith(("exited", "killed"))]
    return {"cut_s": cut_s, "full_service_s": full, "failed_after": load.failed_after(healed),
            "failed_during": sum(1 for r in load.rows if cut_at <= r[0] < healed and r[1] != 200),
            "requests_during": sum(1 for r in load.rows if cut_at <= r[0] < healed),
            "dynamo_exits": len(exits),
            "shard_restarts": sum(1 for name, pid in dynamo.items()
                                  if name != "frontend" and pids.get(name) != pid)}


def restarted(dm: Dynamod, name: str, old_pid: int, also: str | None = None) -> bool:
    """`name` ready in a new process (and `also` ready), read from one status: three reads
    in a row saw the killed unit still ready, then its new pid, and the push went out while
    etcd was still down (the quick profile's failure in CI)."""
    units = {u["name"]: u for u in dm.status()["units"]}
    unit = units[name]
    return (unit["state"] == "ready" and unit["pid"] != old_pid
            and (also is None or units[also]["state"] == "ready"))  # fmt: skip


def kill9_push(cut_s: float | None = None) -> dict[str, Any]:
    """etcd kill -9, then a push; with `cut_s` (the quick profile) an etcd cut of that
    length first, on the same stack and load (its result under `etcd_cut`)."""
    from bench.policy_push import weights

    with state_dir("ok") as state:
        dm = Dynamod(state)
        try:
            dm.up(write_stack(state, state / "cut"))
            path = weights(None).checkpoint
            required: list[int | None] = [0]
            cut: dict[str, Any] = {}
            with Load(frontend_url(dm), required=required) as load:
                time.sleep(3)
                if cut_s:
                    cut["etcd_cut"] = cut_etcd(dm, load, state / "cut", cut_s)
                etcd = dm.unit("etcd-server")
                os.kill(etcd["pid"], signal.SIGKILL)
                wait_until(lambda: restarted(dm, "etcd-server", etcd["pid"], also="etcd"), 60, 0.05,
                           "etcd back")
                started = time.monotonic()
                out = dm.cli("policy", "push", "--step", "1", "--path", str(path), "--json")
                took = time.monotonic() - started
                required[0] = 1
                done = time.monotonic()
                time.sleep(8)
            acks = json.loads(out.stdout)["acks"]
            after = [r for r in load.rows if r[0] >= done]
            return {**cut, "push_s": took,
                    "route_wait_ms": max(a["ms"].get("route", 0) for a in acks.values()),
                    "requests_after": len(after),
                    "failed_after": sum(1 for r in after if r[1] != 200),
                    "stale": sum(1 for r in load.rows if r[1] == 200 and r[2] is not None
                                 and r[3] is not None and r[3] < r[2])}
        finally:
            stop(dm)


def frontend_hang(old: bool, saturate_s: float | None) -> dict[str, Any]:
    with state_dir("oh") as state:
        dm = Dynamod(state)
        try:
            dm.up(write_stack(state, state / "never", old_liveness=old))
            url = frontend_url(dm)
            result: dict[str, Any] = {}
            if saturate_s:
                result.update(saturation(dm, url, saturate_s))
            frontend = dm.unit("frontend")
            with Load(url) as load:
                time.sleep(2)
                stopped_wall, stopped = time.time(), time.monotonic()
                os.kill(frontend["pid"], signal.SIGSTOP)
                wait_until(lambda: restarted(dm, "frontend", frontend["pid"]), 90, 0.05,
                           "frontend replaced")
                back = settle(load, stopped, 30)
            killed = next(e["t"] for e in dm.transitions("frontend")
                          if e["t"] >= stopped_wall and e["new"] in {"backoff", "waiting"})
            result.update(detect_s=killed - stopped_wall, serving_back_s=back,
                          failed=load.failed_after(stopped))
            return result
        finally:
            stop(dm)


def saturation(dm: Dynamod, url: str, seconds: float) -> dict[str, Any]:
    before = dm.unit("frontend")
    started_wall = time.time()

    async def run() -> list[int]:
        codes: list[int] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async def worker() -> None:
                end = time.monotonic() + seconds
                body = {"model": MODEL, "prompt": "busy", "max_tokens": 8}
                while time.monotonic() < end:
                    try:
                        async with session.post(f"{url}/v1/completions", json=body) as resp:
                            await resp.read()
                            codes.append(resp.status)
                    except (aiohttp.ClientError, TimeoutError):
                        codes.append(-1)
            await asyncio.gather(*(worker() for _ in range(64)))
        return codes

    codes = asyncio.run(run())
    after = dm.unit("frontend")
    misses = sum(1 for e in dm.transitions("frontend")
                 if e["t"] >= started_wall and e["new"] == "degraded")
    return {"saturation_requests": len(codes), "saturation_ok": codes.count(200),
            "saturation_rps": len(codes) / seconds,
            "liveness_miss_events": misses,
            "false_restarts": after["restarts"] - before["restarts"]}


def daemon_kill() -> dict[str, Any]:
    with state_dir("od") as state:
        dm = Dynamod(state)
        try:
            stack = write_stack(state, state / "never")
            dm.up(stack)
            status = dm.status()
            old = {i for u in status["units"] if u.get("dynamo")
                   for i in u["dynamo"]["instance_ids"]}
            os.kill(status["daemon_pid"], signal.SIGKILL)
            wait_until(lambda: not any(_alive(u["pid"]) for u in status["units"] if u["pid"]),
                       30, 0.05, "units gone")
            try:
                took = dm.up(stack)
            except RuntimeError as exc:  # keep what says why for the report
                raise RuntimeError(f"{_held_why(dm)}; {str(exc)[-300:]}") from None
            etcd_port = dm.unit("etcd-server")["ports"]["client"]
            left = asyncio.run(_instances(etcd_port)) & old
            return {"up_again_s": took, "dead_instances_left": len(left)}
        finally:
            stop(dm)


def _held_why(dm: Dynamod) -> str:
    """Each unit's state and detail, and where the run's logs were kept."""
    import shutil

    kept = Path(f"/tmp/outages-daemon-kill-{int(time.time())}")
    shutil.copytree(dm.state / "logs", kept / "logs", dirs_exist_ok=True)
    if (dm.state / "daemon.log").exists():
        shutil.copy(dm.state / "daemon.log", kept / "daemon.log")
    try:
        units = "; ".join(f"{u['name']} {u['state']}: {u['detail'][:160]}"
                          for u in dm.status()["units"])
    except Exception as exc:  # the daemon may be gone: the logs still say why
        units = f"no status ({type(exc).__name__})"
    return f"second up failed ({units}); logs kept in {kept}"


def _alive(pid: int) -> bool:
    reap_zombies()  # units of the killed daemon are re-parented to us (a subreaper)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _instances(port: int) -> set[int]:
    from dynamod.rollout import dynamo
    from dynamod.rollout.etcd import EtcdClient

    async with EtcdClient(f"http://127.0.0.1:{port}") as etcd:
        return {i.instance_id for i in await dynamo.list_instances(etcd, "outage")}  # stack id


def etcd_cuts(report: Report) -> dict[str, dict[str, Any]]:
    """The 45 s etcd cut with the stock lease and Dynamo's default one, and the recipe's
    units on the default one, one stack each."""
    variants = [(STOCK, None, False),
                (f"dynamod, lease {OLD_LEASE_S} s (before)", OLD_LEASE_S, False),
                (f"recipe, lease {OLD_LEASE_S} s", OLD_LEASE_S, True)]
    return {variant: r for variant, lease, recipe in variants
            if (r := guarded(f"etcd_cut {variant}", report, etcd_cut, lease, recipe, CUT_S))
            is not None}


def lease_table(report: Report, judged: str = STOCK) -> None:
    """What the cut cost with each lease; the targets are judged on the stock lease."""
    cuts = report.data["etcd_cut"]
    report.tables.append(Table(
        "etcd port cut under load: what Dynamo's lease decides",
        ["variant", "cut s", "full service s after", "failed after", "failed during",
         "shard restarts", "Dynamo process exits"],
        [[v, r["cut_s"], r["full_service_s"], r["failed_after"],
          f"{r['failed_during']} of {r['requests_during']}", r["shard_restarts"],
          r["dynamo_exits"]] for v, r in cuts.items()], digits=2))
    stock = cuts.get(judged)
    if stock is None:
        return
    full, cut = stock["full_service_s"], f"{stock['cut_s']:.0f} s etcd cut"
    if judged == REAL:
        cut += " (real engine)"
    report.target(f"full service after a {cut} ends",
                  full if full is not None else float("nan"), 5, "s")
    report.target(f"shard restarts during a {cut}", stock["shard_restarts"], 0, "")
    report.target(f"Dynamo process exits during a {cut}", stock["dynamo_exits"], 0, "")


def real_engine_cut(report: Report, cut_s: float) -> None:
    """`--real-engine`: the etcd cut on a real dynamo.vllm shard, judged as on our worker."""
    report.data["etcd_cut"] = {}
    if (r := guarded(f"etcd_cut {REAL}", report, etcd_cut, None, False, cut_s, True)):
        report.data["etcd_cut"][REAL] = r
    lease_table(report, REAL)


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--real-engine", action="store_true",
                        help="the etcd cut alone, on one real dynamo.vllm shard")
    args = parser.parse_args()
    bench_mark()
    prebuilt_model()
    report = Report("outages", "8. Outages: fault end -> full service", args.quick)
    if args.real_engine:
        real_engine_cut(report, QUICK_CUT_S if args.quick else CUT_S)
        emit(report, args.json)
        return
    data = report.data
    data["etcd_cut"] = {} if args.quick else etcd_cuts(report)
    kill = guarded("kill9_push", report, kill9_push, QUICK_CUT_S if args.quick else None)
    if kill is not None:
        if "etcd_cut" in kill:  # quick: the cut ran on kill9_push's stack
            data["etcd_cut"][STOCK] = kill.pop("etcd_cut")
        data["kill9_push"] = kill
    data["frontend_hang"] = {}
    # quick: not the hang and saturation (a stack of their own, ~30 s of the suite's time);
    # tests/integration/test_outages_stack.py holds dynamod to the same behaviour
    if not args.quick:
        if (hang := guarded("frontend_hang", report, frontend_hang, False, 30)) is not None:
            data["frontend_hang"]["dynamod"] = hang
        if (old := guarded("frontend_hang recipe", report, frontend_hang, True, None)):
            data["frontend_hang"]["recipe"] = old
        if (killed := guarded("daemon_kill", report, daemon_kill)) is not None:
            data["daemon_kill"] = killed
    table = Table("Fault end -> full service", ["fault", "variant", "full service s",
                                                  "failed requests", "other"], digits=2)
    for variant, r in data["etcd_cut"].items():
        table.rows.append([f"etcd port cut {r['cut_s']:.0f} s", variant, r["full_service_s"],
                           r["failed_after"], "after the cut ended"])
    k = data.get("kill9_push", {"push_s": None, "failed_after": float("nan"), "stale": 0,
                                 "route_wait_ms": float("nan"), "requests_after": 0})
    table.rows.append(["etcd kill -9, then push", "dynamod", k["push_s"], k["failed_after"],
                       f"route wait {k['route_wait_ms']:.0f} ms; {k['stale']} stale; "
                       f"{k['requests_after']} requests for v1 after"])
    for variant, r in data["frontend_hang"].items():
        table.rows.append(["frontend SIGSTOP", variant, r["serving_back_s"], r["failed"],
                           f"detected {r['detect_s']:.2f} s after the stop"])
    if "daemon_kill" in data:
        d = data["daemon_kill"]
        table.rows.append(["dynamod SIGKILL, up again", "dynamod", d["up_again_s"], "-",
                           f"{d['dead_instances_left']} dead instances left"])
    report.tables.append(table)
    lease_table(report)
    report.target("requests failed or stale around a push after etcd's return",
                  k["failed_after"] + k["stale"], 0, "")
    if not args.quick:  # a hang that crashed in the full run: missed targets below (NaN)
        hang_targets(report, data["frontend_hang"].get("dynamod"))
    emit(report, args.json)


def hang_targets(report: Report, hang: dict[str, Any] | None) -> None:
    """The frontend hang's and saturation's table and targets (NaN where it did not run)."""
    s = hang or {
        "saturation_requests": 0, "saturation_ok": 0, "saturation_rps": float("nan"),
        "liveness_miss_events": None, "false_restarts": float("nan"), "serving_back_s": None}
    report.tables.append(Table(
        "Saturating load on the frontend (64 in flight)",
        ["requests", "ok", "req/s", "liveness misses", "restarts (false positives)"],
        [[s["saturation_requests"], s["saturation_ok"], s["saturation_rps"],
          s["liveness_miss_events"], s["false_restarts"]]]))
    back = s["serving_back_s"]
    report.target("serving back after a frontend hang begins",
                  back if back is not None else float("nan"), 3, "s")
    report.target("false restarts under saturating load", s["false_restarts"], 0, "")


if __name__ == "__main__":
    main()
