"""Benchmark 7 - policy push: one update to 2, 4 and 8 shards (in parallel), and the replay
into one rejoining shard, against the size of the weights.

    python -m bench.policy_push [--quick] [--json]

Models: the tiny model (0.5 MB of float32 weights), and the same model built at about
10 MB and 100 MB: its tokenizer and config with the hidden and MLP sizes scaled up (2
layers, 4 heads, 2 KV heads, as the tiny one), weights drawn by the project's model builder
(dynamod/workers/model.py). The workers serve that model, so every checkpoint pushed holds
the model's own tensor names and shapes (another seed) and the engines accept it; the CPU
worker loads and digests every tensor in the file (dynamod/workers/weights.py). Models and
checkpoints are built once into dynamod's cache dir (`bench/` beside the tiny model) and
read from the page cache. For each shard count and size the serve-only local stack runs with
`--var workers=N --var model_dir=DIR`; each push is `dynamod policy push --step K --path
CKPT --json` (a new step each time). Reported: the CLI's wall time, the daemon's own
`seconds`, and the slowest shard's per-step ms (pause, load = update_weights_from_disk incl.
digest and KV reset, kv_reset = flush_cache, verify, taint, resume). Replay: on the 2-shard
stacks, after the pushes, worker@k is SIGKILLed and its held -> ready admission (the same
steps, from daemon.log) is timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import (
    bench_mark,
    state_dir,
    sweep,
    wait_until,
)
from bench.recovery import admission_ms
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
)
from bench.stack import (
    MODEL,
    prebuilt_model,
    serve_stack,
)

STEPS = ("pause", "load", "kv_reset", "verify", "taint", "resume")
PUSH_SEED = 1  # the served model is drawn with dynamod.workers.model's DEFAULT_SEED (0)

# --------------------------------------------------------------------------- the weights


@dataclass(frozen=True)
class Weights:
    """A model the workers serve and a checkpoint of the same shapes to push into them."""

    model_dir: Path
    checkpoint: Path
    mb: float  # the checkpoint file's size


def cache_root() -> Path:
    from dynamod.core import paths

    return paths.cache_dir() / "bench"


def fingerprint(model_dir: Path) -> str:
    """Short hash of a model's config and tokenizer: a cached build follows the tiny model."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        digest.update((model_dir / name).read_bytes())
    return digest.hexdigest()[:10]


def scaled_config(base: dict[str, Any], megabytes: int) -> dict[str, Any]:
    """`base` (the tiny model's config.json) with the hidden size (a multiple of 16, the
    MLP twice as wide) whose float32 weights come closest to `megabytes`."""
    vocab, layers = base["vocab_size"], base["num_hidden_layers"]
    heads, kv_heads = base["num_attention_heads"], base["num_key_value_heads"]

    def params(hidden: int) -> int:
        kv_width = hidden // heads * kv_heads
        attention = 2 * hidden * hidden + 2 * hidden * kv_width
        layer = attention + 3 * hidden * 2 * hidden + 2 * hidden
        return 2 * vocab * hidden + layers * layer + hidden

    target = megabytes * 1024 * 1024 / 4
    hidden = min(range(16, 16385, 16), key=lambda h: abs(params(h) - target))
    return {
        **base,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "head_dim": hidden // heads,
    }


def write_weights(file: Path, model_dir: Path, seed: int) -> None:
    """Random weights of `model_dir`'s config (its own tensor names and shapes), drawn by
    the model builder the tiny model comes from."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from dynamod.workers.model import _random_weights

    config = LlamaConfig.from_pretrained(str(model_dir))
    save_file(_random_weights(config, seed), str(file), metadata={"seed": str(seed)})


@contextmanager
def built(path: Path) -> Iterator[Path]:
    """A staging directory beside `path`, renamed to `path` once the body completes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def model_at(megabytes: int | None) -> Path:
    """The tiny model (None), or the tiny model built at about `megabytes`."""
    from dynamod.workers.model import DEFAULT_SEED, check_model_dir, missing_model_files

    tiny = prebuilt_model()
    if megabytes is None:
        return tiny
    path = cache_root() / "models" / f"{MODEL}-{megabytes}MB-{fingerprint(tiny)}"
    if missing_model_files(path):
        with built(path) as staging:
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                shutil.copy(tiny / name, staging / name)
            config = scaled_config(json.loads((tiny / "config.json").read_text()), megabytes)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            write_weights(staging / "model.safetensors", staging, DEFAULT_SEED)
    check_model_dir(path)
    return path


def weights(megabytes: int | None) -> Weights:
    """The model of about `megabytes` and a checkpoint for it (another seed), both built
    once and read into the page cache."""
    model_dir = model_at(megabytes)
    path = cache_root() / "checkpoints" / f"{model_dir.name}-{fingerprint(model_dir)}"
    file = path / "model.safetensors"
    if not file.is_file():
        with built(path) as staging:
            write_weights(staging / "model.safetensors", model_dir, PUSH_SEED)
    for f in (file, model_dir / "model.safetensors"):
        f.read_bytes()  # into the page cache
    return Weights(model_dir, path, round(file.stat().st_size / 1024 / 1024, 2))


# --------------------------------------------------------------------------- measuring


def push(dm: Dynamod, step: int, path: Path) -> dict[str, Any]:
    started = time.monotonic()
    out = dm.cli("policy", "push", "--step", str(step), "--path", str(path), "--json", timeout=600)
    wall = time.monotonic() - started
    result: dict[str, Any] = json.loads(out.stdout)
    acks = result["acks"]
    bad = {k: v.get("error") or v for k, v in acks.items() if not v.get("ok")}
    if bad:
        raise RuntimeError(f"push of step {step} ({path}) failed on {bad}")
    slowest = max(acks.values(), key=lambda a: a["total_ms"])
    return {
        "wall_s": wall,
        "daemon_s": result["seconds"],
        "slowest_ms": slowest["ms"],
        "slowest_total_ms": slowest["total_ms"],
        "shard_total_ms": {k: v["total_ms"] for k, v in acks.items()},
    }


def replay(dm: Dynamod, unit: str) -> dict[str, Any]:
    before = dm.unit(unit)
    t_kill = time.time()
    os.kill(before["pid"], signal.SIGKILL)

    def back() -> dict[str, Any] | None:
        u = dm.unit(unit)
        if u["state"] == "failed":
            raise RuntimeError(f"{unit} failed after the kill: {u['detail']}")
        return u if u["pid"] not in (None, before["pid"]) and u["state"] == "ready" else None

    wait_until(back, 120, 0.05, f"{unit} admitted again")
    events = [e for e in dm.transitions(unit) if e["t"] >= t_kill]
    held = next(e for e in events if e["new"] == "held")
    ready = next(e for e in events if e["new"] == "ready" and e["old"] == "held")
    steps = admission_ms(ready["detail"])
    return {
        "held_to_ready_s": ready["t"] - held["t"],
        "steps_ms": steps,
        "steps_total_ms": sum(steps.values()),
    }


def one_stack(n: int, w: Weights, reps: int, replays: int) -> tuple[list[Any], list[Any]]:
    """`reps` pushes of `w` into an `n`-shard stack serving its model, then `replays`
    kills of a shard (alternating, to stay within the restart limit)."""
    pushes: list[dict[str, Any]] = []
    replayed: list[dict[str, Any]] = []
    with state_dir("pp") as state:
        dm = Dynamod(state)
        try:
            dm.up(serve_stack(state), f"workers={n}", f"model_dir={w.model_dir}", timeout=300)
            for step in range(1, reps + 1):
                pushes.append({"shards": n, "mb": w.mb, **push(dm, step, w.checkpoint)})
            for k in range(replays):
                unit = f"worker@{k % 2}"
                replayed.append({"mb": w.mb, "unit": unit, **replay(dm, unit)})
        finally:
            dm.close()
    return pushes, replayed


# --------------------------------------------------------------------------- the report


def push_table(counts: list[int], sizes: list[Weights], reps: int, pushes: list[Any]) -> Table:
    table = Table(
        f"Push one update to every shard in parallel ({reps} pushes each), seconds",
        [
            "shards",
            "weights MB",
            "CLI wall median",
            "p95",
            "daemon median",
            "p95",
            *[f"slowest shard {s} ms" for s in STEPS],
        ],
        digits=3,
    )
    for n in counts:
        for w in sizes:
            rows = [p for p in pushes if p["shards"] == n and p["mb"] == w.mb]
            wall, daemon = summary(p["wall_s"] for p in rows), summary(p["daemon_s"] for p in rows)
            steps = [summary(p["slowest_ms"].get(s, 0) for p in rows)["median"] for s in STEPS]
            table.rows.append(
                [n, w.mb, wall["median"], wall["p95"], daemon["median"], daemon["p95"], *steps]
            )
    return table


def replay_table(n: int, sizes: list[Weights], replays: list[Any]) -> Table:
    table = Table(
        f"Replay into one rejoining shard ({n}-shard stack): held -> ready",
        ["weights MB", "replays", "held -> ready s (median)", *[f"{s} ms" for s in STEPS]],
        digits=3,
    )
    for w in sizes:
        rows = [r for r in replays if r["mb"] == w.mb]
        steps = [summary(r["steps_ms"].get(s, 0) for r in rows)["median"] for s in STEPS]
        held = summary(r["held_to_ready_s"] for r in rows)["median"]
        table.rows.append([w.mb, len(rows), held, *steps])
    return table


@entry
def main() -> None:
    args = options(__doc__.splitlines()[0]).parse_args()
    bench_mark()
    if args.quick:
        counts, megabytes, reps, replays = [2], [10], 2, 1  # one stack: a smoke run
    else:
        counts, megabytes, reps, replays = [2, 4, 8], [None, 10, 100], 5, 2
    report = Report("policy_push", "7. Policy push and replay against weight size", args.quick)
    sizes = [weights(mb) for mb in megabytes]
    pushes: list[dict[str, Any]] = []
    replayed: list[dict[str, Any]] = []
    try:
        for n in counts:
            for w in sizes:
                done, back = one_stack(n, w, reps, replays if n == counts[0] else 0)
                pushes += done
                replayed += back
    finally:
        sweep()
    report.tables += [
        push_table(counts, sizes, reps, pushes),
        replay_table(counts[0], sizes, replayed),
    ]
    report.data = {
        "pushes": pushes,
        "replays": replayed,
        "weights": [
            {"model_dir": str(w.model_dir), "checkpoint": str(w.checkpoint), "mb": w.mb}
            for w in sizes
        ],
    }
    report.notes += [
        "every size is its own model (the tiny model, or it built wider): the workers serve "
        "it and each push is a checkpoint of its own tensor shapes.",
        "`load` is the worker's update_weights_from_disk: read every tensor, sha256 digest, "
        "and the KV reset it does itself after new weights; `kv_reset` is the separate "
        "flush_cache the rejoin protocol then asks for.",
        "the CLI wall time adds the `dynamod policy push` process (interpreter start, imports).",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
