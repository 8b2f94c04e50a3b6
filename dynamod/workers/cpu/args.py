"""The CPU worker's command line (its own flags plus dynamo.mocker's) and environment."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dynamod.workers.cpu.errors import WorkerError

# Set to "1" by dynamod's policy manager on every rollout shard it spawns: the worker
# starts paused and serves nothing until dynamod's rejoin (replay, KV reset, verify,
# taint) ends with resume_generation. Same as --start-paused; stacks without a [policy]
# (nothing would ever resume the worker) do not get it. dynamod/rollout/policy.py names it
# too (neither layer may import the other; a unit test holds them equal).
START_PAUSED_ENV = "DYNAMOD_WORKER_START_PAUSED"

# The longest engine reset `--modeled-reset-s` models: a full copy of a large model's
# weights to an accelerator takes seconds, not minutes.
MODELED_RESET_MAX_S = 60.0

# What OpenBLAS (numpy's wheels), OpenMP and MKL read once, when numpy loads.
BLAS_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def parse_version(text: str) -> int | str:
    """`--initial-version` as the JSON value a trainer would send: an integer step or text."""
    try:
        return int(text)
    except ValueError:
        return text


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(own options, dynamo.mocker's options); every dynamo.mocker flag is accepted."""
    own = argparse.ArgumentParser(
        prog="python -m dynamod.workers.cpu",
        description=(
            "CPU rollout worker: the tiny Llama generating with numpy (or Dynamo's mocker "
            "engine) behind dynamo.vllm's RL admin routes. Also accepts the flags of "
            "`python -m dynamo.mocker` (--model-path, --model-name, --endpoint, "
            "--discovery-backend, --block-size, --speedup-ratio, ...)."
        ),
    )
    _add_engine_options(own)
    _add_weights_options(own)
    ours, rest = own.parse_known_args(argv)
    if ours.threads < 1 or ours.cache_blocks < 1:
        raise WorkerError("--threads and --cache-blocks must be at least 1")
    if ours.modeled_reset_s is not None:
        if ours.engine != "mocker":
            raise WorkerError("--modeled-reset-s models the mocker's reset: add --engine mocker")
        if not 0 <= ours.modeled_reset_s <= MODELED_RESET_MAX_S:
            raise WorkerError(
                f"--modeled-reset-s: seconds from 0 to {MODELED_RESET_MAX_S:g}, "
                f"got {ours.modeled_reset_s:g}"
            )

    from dynamo.mocker.args import parse_args as parse_mocker_args

    mocker = parse_mocker_args(rest)
    unsupported = [
        (mocker.num_workers != 1, "--num-workers (run one worker process per replica)"),
        (mocker.disaggregation_mode != "agg", "--disaggregation-mode other than agg"),
        (bool(mocker.bootstrap_ports_list), "--bootstrap-ports"),
        (bool(mocker.zmq_kv_events_ports_list), "--zmq-kv-events-ports"),
    ]
    for bad, what in unsupported:
        if bad:
            raise WorkerError(f"{what} is not supported by the CPU worker")
    if not mocker.model_path:
        raise WorkerError("--model-path is required (a local model directory)")
    return ours, mocker


def _add_engine_options(own: argparse.ArgumentParser) -> None:
    """Which engine generates, and with what: threads, cache, drain."""
    own.add_argument(
        "--engine",
        choices=("numpy", "mocker"),
        default="numpy",
        help="numpy: the model at the weights held (default); mocker: random tokens, for scale",
    )
    own.add_argument(
        "--threads",
        "--torch-threads",  # its name while the engine ran on torch
        dest="threads",
        type=int,
        default=1,
        help=(
            "BLAS threads of the numpy engine (default 1: one core per worker); sets "
            f"{', '.join(BLAS_THREAD_ENV)} before numpy loads"
        ),
    )
    own.add_argument(
        "--cache-blocks",
        type=int,
        default=4096,
        help="prefix cache capacity of the numpy engine, in blocks (default 4096)",
    )
    own.add_argument(
        "--modeled-reset-s",
        type=float,
        default=None,
        metavar="S",
        help=(
            "mocker only, for benchmarks of the control plane at a size one machine's cores "
            "cannot build engines for (bench.fleet --modeled-reset): an engine reset (new "
            "weights, a flush, a sleep) keeps the engine and waits S seconds off the CPU, "
            "as an accelerator's in-place copy would, instead of building a new engine on "
            "a new Dynamo runtime. The router is told the worker's blocks are gone as after "
            "a real reset; the mocker's own prefix cache is kept"
        ),
    )
    own.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a cache flush waits for requests to leave the engine (default 60)",
    )


def _add_weights_options(own: argparse.ArgumentParser) -> None:
    """The weights' side: the version declared at start, starting paused for dynamod's
    rejoin, a hosted vLLM worker extension, and a test-only stale shard."""
    own.add_argument(
        "--initial-version",
        help="weight version declared at start (an integer step or text); default: undeclared",
    )
    own.add_argument(
        "--start-paused",
        action="store_true",
        default=os.environ.get(START_PAUSED_ENV) == "1",
        help=(
            "start paused: a request that reaches the worker waits until "
            "resume_generation admits it (dynamod sets this on the shards it supervises, "
            f"via {START_PAUSED_ENV}=1); health probes pass. Default: serve at once"
        ),
    )
    own.add_argument(
        "--test-serve-previous-weights",
        action="store_true",
        help=(
            "TEST ONLY: generate with the weights of the update before the last one while "
            "reporting the last one's version and digest (a stale shard, for checkers)"
        ),
    )
    own.add_argument(
        "--worker-extension-cls",
        help=(
            "a vLLM worker extension class (module.Class), hosted as vLLM's GPU worker "
            "hosts it: its load_weights feeds this worker's update path"
        ),
    )


def set_blas_threads(threads: int) -> None:
    """Give BLAS `threads` threads: read by numpy's BLAS when numpy loads, so the worker's
    `main` calls this before anything imports numpy (its engine does, when built)."""
    if "numpy" in sys.modules:
        raise WorkerError(
            "numpy was imported before --threads could be applied (an import in "
            "dynamod.workers.cpu loads it too early)"
        )
    for name in BLAS_THREAD_ENV:
        os.environ[name] = str(threads)


def check_system_port() -> None:
    raw = os.environ.get("DYN_SYSTEM_PORT", "")
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port <= 32767:
        raise WorkerError(
            f"DYN_SYSTEM_PORT={raw!r}: set it to a port in 1..32767 "
            "(Dynamo reads it as a 16-bit signed integer); /health and /engine/* live there"
        )


def engine_args_for(mocker: argparse.Namespace) -> dict[str, Any]:
    from dynamo.mocker.config import apply_worker_engine_args_overrides, load_mocker_engine_args
    from dynamo.mocker.utils.kv_cache import compute_kv_bytes_per_token

    kv_bytes = mocker.kv_bytes_per_token
    if kv_bytes is None:
        kv_bytes = compute_kv_bytes_per_token(mocker.model_path, mocker.kv_cache_dtype)
    engine_args: dict[str, Any] = apply_worker_engine_args_overrides(
        load_mocker_engine_args(mocker), kv_bytes_per_token=kv_bytes
    )
    return engine_args
