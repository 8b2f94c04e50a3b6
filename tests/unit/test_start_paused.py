"""A supervised CPU worker starts paused: a request that reaches it before dynamod's rejoin
waits, and is served at the version the rejoin installed; health probes pass the pause; a
worker started without dynamod serves at once, as before. dynamod's policy manager asks for
it on its shards only (DYNAMOD_WORKER_START_PAUSED)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.rollout import policy
from dynamod.rollout.policy_table import PolicySpec
from dynamod.rollout.registrations import DynamoRegistrations
from dynamod.workers.cpu import args
from dynamod.workers.cpu.admission import CpuWorker
from dynamod.workers.weights import load_checkpoint, state_dict_digest
from tests.unit.test_worker_weights import IdleEngine, save, tensors


def boot_worker(tmp_path: Path, start_paused: bool) -> CpuWorker:
    """As serve.py builds it: the boot weights, no version declared."""
    boot = load_checkpoint(save(tmp_path / "boot", tensors(0)))
    return CpuWorker(IdleEngine(), boot, start_paused=start_paused)  # type: ignore[arg-type]


async def collect(worker: CpuWorker, request: dict[str, Any]) -> list[Any]:
    return [chunk async for chunk in worker.generate(request)]


async def test_a_request_to_a_worker_started_paused_waits_for_the_rejoin(tmp_path: Path) -> None:
    worker = boot_worker(tmp_path, start_paused=True)
    pending = asyncio.create_task(collect(worker, {"token_ids": [1]}))
    await asyncio.sleep(0.05)
    assert not pending.done(), "served before it was admitted"
    # dynamod's rejoin: pause (already paused) -> load -> flush -> verify -> resume
    assert (await worker.pause_generation({}))["status"] == "ok"
    save(tmp_path / "step-7", tensors(7))
    loaded = await worker.update_weights_from_disk(
        {"model_path": str(tmp_path / "step-7"), "weight_version": 7}
    )
    assert loaded["status"] == "ok", loaded
    assert (await worker.flush_cache({}))["status"] == "ok"
    await asyncio.sleep(0.05)
    assert not pending.done(), "served before resume_generation"
    await worker.resume_generation({})
    chunks = await asyncio.wait_for(pending, 2)
    assert chunks[-1]["engine_data"]["weight_version"] == 7
    assert chunks[-1]["engine_data"]["weight_digest"] == state_dict_digest(tensors(7))


async def test_an_update_needs_no_pause_call_on_a_worker_started_paused(tmp_path: Path) -> None:
    worker = boot_worker(tmp_path, start_paused=True)
    save(tmp_path / "step-1", tensors(1))
    reply = await worker.update_weights_from_disk({"model_path": str(tmp_path / "step-1")})
    assert reply["status"] == "ok", reply
    assert (await worker.liveness_probe({}))["paused"] is True


async def test_health_probes_pass_the_start_pause(tmp_path: Path) -> None:
    from dynamo.common.backend.health_check import HEALTH_CHECK_KEY

    worker = boot_worker(tmp_path, start_paused=True)
    probe = {"token_ids": [1], HEALTH_CHECK_KEY: True}
    chunks = await asyncio.wait_for(collect(worker, probe), 2)
    assert chunks and chunks[-1]["finish_reason"] == "length"


async def test_a_worker_started_without_the_flag_serves_at_once(tmp_path: Path) -> None:
    worker = boot_worker(tmp_path, start_paused=False)
    chunks = await asyncio.wait_for(collect(worker, {"token_ids": [1]}), 2)
    assert chunks[-1]["engine_data"]["weight_version"] is None  # undeclared boot weights


@pytest.mark.parametrize("argv, env, expect", [
    ([], None, False),
    (["--start-paused"], None, True),
    ([], "1", True),
    ([], "0", False),
])
def test_start_paused_comes_from_the_flag_or_dynamods_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None,
    expect: bool,
) -> None:
    if env is None:
        monkeypatch.delenv(args.START_PAUSED_ENV, raising=False)
    else:
        monkeypatch.setenv(args.START_PAUSED_ENV, env)
    ours, _ = args.parse_args(["--model-path", str(tmp_path), *argv])
    assert ours.start_paused is expect


def test_the_policy_manager_starts_its_shards_paused_and_nothing_else() -> None:
    assert policy.START_PAUSED_ENV == args.START_PAUSED_ENV  # one protocol, named twice
    spec = PolicySpec(store="file", shards=["worker"])
    manager = policy.PolicyManager(spec, DynamoRegistrations())
    manager.shard_names = {"worker@0", "worker@1"}
    shard, frontend = SimpleNamespace(name="worker@1"), SimpleNamespace(name="frontend")
    assert manager.spawn_env(shard) == {args.START_PAUSED_ENV: "1"}  # type: ignore[arg-type]
    assert manager.spawn_env(frontend) == {}  # type: ignore[arg-type]
