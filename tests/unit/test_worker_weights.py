"""Weights of the CPU worker: the digest, checkpoint loading, and the update rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dynamod.workers.cpu.admission import PAUSE_REQUIRED, CpuWorker
from dynamod.workers.cpu.args import parse_version
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.model import check_model_dir, missing_model_files
from dynamod.workers.weights import (
    WEIGHTS_FILE,
    CheckpointError,
    WeightSet,
    load_checkpoint,
    state_dict_digest,
)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "b.weight": torch.randn(3, 4, generator=generator),
        "a.bias": torch.randn(4, generator=generator),
        "scalar": torch.tensor(1.5),
    }


def save(path: Path, state: dict[str, torch.Tensor], **metadata: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / WEIGHTS_FILE), metadata=metadata or None)
    return path


# ------------------------------------------------------------------------- digest


def test_digest_is_stable_and_ignores_key_order() -> None:
    state = tensors()
    reordered = dict(reversed(list(state.items())))
    assert state_dict_digest(state) == state_dict_digest(reordered)
    assert len(state_dict_digest(state)) == 64


def test_digest_changes_with_any_value_name_dtype_or_shape() -> None:
    state = tensors()
    base = state_dict_digest(state)
    nudged = {**state, "a.bias": state["a.bias"].clone()}
    nudged["a.bias"][0] += 1e-6
    renamed = {("c.weight" if k == "b.weight" else k): v for k, v in state.items()}
    as_double = {**state, "scalar": state["scalar"].double()}
    reshaped = {**state, "b.weight": state["b.weight"].reshape(4, 3)}
    variants = [nudged, renamed, as_double, reshaped]
    digests = {state_dict_digest(v) for v in variants}
    assert base not in digests and len(digests) == len(variants)


def test_digest_covers_bfloat16_and_non_contiguous_tensors() -> None:
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert state_dict_digest({"m": matrix.t()}) == state_dict_digest({"m": matrix.t().clone()})
    assert state_dict_digest({"m": matrix.bfloat16()}) != state_dict_digest({"m": matrix})


def test_a_resaved_checkpoint_has_the_same_digest(tmp_path: Path) -> None:
    state = tensors()
    first = load_checkpoint(save(tmp_path / "one", state, step="1"))
    second = load_checkpoint(save(tmp_path / "two", dict(reversed(list(state.items())))))
    assert first.digest == second.digest == state_dict_digest(state)
    assert first.source == tmp_path / "one" / WEIGHTS_FILE
    assert first.num_tensors == 3 and first.num_bytes == (12 + 4 + 1) * 4


# -------------------------------------------------------------- checkpoint errors


def test_missing_checkpoint_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path / "nope")
    assert error.value.path == tmp_path / "nope"
    assert str(tmp_path / "nope") in str(error.value)


def test_missing_weights_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert error.value.path == tmp_path / WEIGHTS_FILE
    assert "does not exist" in str(error.value)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"\x08" + b"\x00" * 7 + b"{}"])
def test_corrupt_weights_file_is_named(tmp_path: Path, content: bytes) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(content)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert error.value.path == tmp_path / WEIGHTS_FILE


def test_truncated_weights_file_is_named(tmp_path: Path) -> None:
    save(tmp_path, tensors())
    data = (tmp_path / WEIGHTS_FILE).read_bytes()
    (tmp_path / WEIGHTS_FILE).write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path)


def test_a_file_path_is_accepted_as_well_as_its_directory(tmp_path: Path) -> None:
    save(tmp_path, tensors())
    assert load_checkpoint(tmp_path / WEIGHTS_FILE).digest == load_checkpoint(tmp_path).digest


# ------------------------------------------------------------------- model dir check


def test_model_dir_check_names_the_missing_files(tmp_path: Path) -> None:
    assert missing_model_files(tmp_path / "absent") == missing_model_files(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    missing = missing_model_files(tmp_path)
    assert "config.json" not in missing and WEIGHTS_FILE in missing
    with pytest.raises(Exception, match=f"{tmp_path} is missing .*tokenizer.json"):
        check_model_dir(tmp_path)


def test_model_dir_without_architectures_is_refused(tmp_path: Path) -> None:
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    save(tmp_path, tensors())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="architectures"):
        check_model_dir(tmp_path)


# ------------------------------------------------------------------ update rules


class IdleEngine:
    """Stands in for an engine: never serves, counts resets, remembers its weights."""

    def __init__(self) -> None:
        self.generation = 1
        self.alive = True
        self.lost = False  # its instance gone from its discovery (the mocker's)
        self.weights: WeightSet | None = None
        self.refuse: str | None = None  # what check_weights says, where set

    def reachable(self) -> bool:
        return self.alive and not self.lost

    def check_weights(self, weights: WeightSet) -> None:
        if self.refuse is not None:
            raise WorkerError(f"{weights.source}: {self.refuse}")

    def use_weights(self, weights: WeightSet) -> None:
        self.weights = weights

    def stats(self) -> dict[str, Any]:
        return {}

    async def restart(self) -> None:
        self.generation += 1
        self.lost = False

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        yield {"token_ids": [1], "index": 0, "finish_reason": "length"}


def worker_with(tmp_path: Path) -> tuple[CpuWorker, IdleEngine]:
    initial = load_checkpoint(save(tmp_path / "initial", tensors(0)))
    engine = IdleEngine()
    worker = CpuWorker(engine, initial, version=3, version_declared=True)  # type: ignore[arg-type]
    return worker, engine


async def test_update_is_refused_unless_paused(tmp_path: Path) -> None:
    worker, engine = worker_with(tmp_path)
    save(tmp_path / "next", tensors(1))
    reply = await worker.update_weights_from_disk({"model_path": str(tmp_path / "next")})
    assert reply == {"status": "error", "message": PAUSE_REQUIRED}
    assert engine.generation == 1


async def test_update_swaps_weights_sets_version_and_resets_the_cache(tmp_path: Path) -> None:
    worker, engine = worker_with(tmp_path)
    save(tmp_path / "next", tensors(1))
    await worker.pause_generation({})
    reply = await worker.update_weights_from_disk(
        {"model_path": str(tmp_path / "next"), "weight_version": 4}
    )
    assert reply["status"] == "ok" and reply["version"] == 4
    assert reply["digest"] == state_dict_digest(tensors(1))
    assert engine.generation == 2
    assert engine.weights is worker.weights  # the engine restarted on the new weights
    assert await worker.get_weight_version({}) == {
        "status": "ok",
        "version": 4,
        "version_declared": True,
        "digest": state_dict_digest(tensors(1)),
        "model_path": str(tmp_path / "next" / WEIGHTS_FILE),
    }


async def test_a_test_stale_worker_serves_the_weights_before_but_reports_the_new(
    tmp_path: Path,
) -> None:
    worker, engine = worker_with(tmp_path)
    worker.serve_previous_weights = True
    initial = worker.weights
    for step in (1, 2):
        save(tmp_path / f"step-{step}", tensors(step))
    await worker.pause_generation({})
    first = await worker.update_weights_from_disk({"model_path": str(tmp_path / "step-1")})
    assert first["digest"] == state_dict_digest(tensors(1))
    assert engine.weights is initial
    one_behind = worker.weights
    await worker.update_weights_from_disk({"model_path": str(tmp_path / "step-2")})
    assert engine.weights is one_behind
    assert (await worker.get_weight_version({}))["digest"] == state_dict_digest(tensors(2))


async def test_failed_update_keeps_old_weights_version_and_cache(tmp_path: Path) -> None:
    worker, engine = worker_with(tmp_path)
    before: WeightSet = worker.weights
    await worker.pause_generation({})
    reply = await worker.update_weights_from_disk(
        {"model_path": str(tmp_path / "gone"), "weight_version": 9}
    )
    assert reply["status"] == "error" and str(tmp_path / "gone") in reply["message"]
    assert worker.weights is before and worker.version == 3 and engine.generation == 1


async def test_weights_the_engine_cannot_start_on_are_refused_before_it_stops(
    tmp_path: Path,
) -> None:
    """The engine's check refuses the checkpoint (it does not fit the model): the reply
    names it, and the running engine is neither restarted nor given the weights, so the
    worker keeps serving what it served (a restart on them would have ended the worker)."""
    worker, engine = worker_with(tmp_path)
    before: WeightSet = worker.weights
    engine.refuse = "weights do not fit the config: unexpected padding"
    save(tmp_path / "next", tensors(1))
    await worker.pause_generation({})
    reply = await worker.update_weights_from_disk(
        {"model_path": str(tmp_path / "next"), "weight_version": 4}
    )
    assert reply["status"] == "error", reply
    assert reply["message"] == (
        f"weights not loaded, old weights kept: {tmp_path / 'next' / WEIGHTS_FILE}: "
        "weights do not fit the config: unexpected padding"
    )
    assert worker.weights is before and worker.version == 3
    assert engine.generation == 1 and engine.weights is None


async def test_requests_wait_while_paused(tmp_path: Path) -> None:
    worker, _ = worker_with(tmp_path)
    await worker.pause_generation({"mode": "keep"})

    async def one_request() -> list[Any]:
        return [chunk async for chunk in worker.generate({"token_ids": [1]})]

    pending = asyncio.create_task(one_request())
    await asyncio.sleep(0.05)
    assert not pending.done()
    await worker.resume_generation({})
    chunks = await asyncio.wait_for(pending, 2)
    assert chunks[-1]["engine_data"] == {
        "weight_version": 3,
        "weight_digest": worker.weights.digest,
        "instance_id": None,
    }


def test_initial_version_is_an_int_when_it_looks_like_one() -> None:
    assert parse_version("12") == 12
    assert parse_version("step-12") == "step-12"


async def test_an_engine_that_cannot_be_reached_is_built_again(tmp_path: Path) -> None:
    """The mocker's instance dropped from its discovery (a starved worker): after two looks
    the worker builds a new engine, once; a reachable or a dead engine is left alone."""
    worker, engine = worker_with(tmp_path)
    watching = asyncio.ensure_future(worker.keep_reachable(every=0.01))
    try:
        await asyncio.sleep(0.1)
        assert engine.generation == 1  # reachable: nothing done
        engine.lost = True
        for _ in range(200):
            if engine.generation > 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert engine.generation == 2 and engine.reachable()  # one new engine, then calm
        engine.alive, engine.lost = False, True  # dead: the engine's death path, not this
        await asyncio.sleep(0.1)
        assert engine.generation == 2
    finally:
        watching.cancel()
