"""`DynamodServerAdapter`: verl's rollout object inside the trainer's workers (BaseRollout).

verl's naive weight sync (`checkpoint_engine.backend=naive`, colocated trainer) calls
`rollout.update_weights(per_tensor_generator, global_steps=N)` on every trainer rank.
Here that ends in the policy ledger: rank 0 writes the tensors as
`<checkpoint_dir>/step-N/model.safetensors` and runs `policy push` (every admitted shard
pauses, loads, flushes its KV cache, is verified and re-tainted, resumes); the other ranks
drain the generator (it may gather shards collectively) and return. The step lands in the
ledger, so a shard that missed it, or restarts later, is held and replayed by dynamod
from that checkpoint. With `weight_sync: ipc` (colocated GPUs) every rank sends its
tensors to its shards' worker extension instead and rank 0 publishes the step
(`colocated.ColocatedSync`). `resume` wakes the replica's shards the trainer slept
(verl's sleep/wake cycle around each update); `release` is a no-op: the shards' memory
is theirs, freed through the replica's sleep.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog
from verl.workers.rollout.base import BaseRollout

from dynamod.integrations.verl import checkpoint, updates
from dynamod.integrations.verl.attach import node_state_dir, state_dir_of
from dynamod.integrations.verl.colocated import ColocatedSync
from dynamod.integrations.verl.config import parse_settings
from dynamod.integrations.verl.errors import VerlIntegrationError
from dynamod.integrations.verl.ranks import local_world_size, node_replica
from dynamod.integrations.verl.versions import StepVersions, new_run_id

log = structlog.get_logger("dynamod.integrations.verl")


class DynamodServerAdapter(BaseRollout):  # type: ignore[misc]
    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.settings = parse_settings(dict(self.config.engine_kwargs or {}))
        configured = state_dir_of(self.settings)
        self.state_dir = node_state_dir(configured)  # this rank's node's daemon
        default_root = configured / "verl" / "checkpoints"  # one folder for every node
        self.checkpoint_dir = self.settings.checkpoint_dir or default_root
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_world = world
        self.rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = self.rank // world
        self.is_leader_rank = self.rank % world == 0
        self.last_push: dict[str, Any] | None = None
        self.versions = StepVersions(self.settings.run_name or new_run_id())
        self.colocated: ColocatedSync | None = None
        if self.settings.weight_sync == "ipc":
            self.colocated = ColocatedSync(
                state_dir=self.state_dir,
                checkpoint_dir=self.checkpoint_dir,
                ipc_dir=self.settings.ipc_dir or self.state_dir / "weight-ipc",
                rank=self.rank,
                world=int(os.environ.get("WORLD_SIZE", "1")),
                local_world=local_world_size(),
                keep=self.settings.checkpoint_keep,
                bucket_bytes=self.settings.ipc_bucket_mb << 20,
                background_write=self.settings.checkpoint_write == "background",
            )

    async def resume(self, tags: list[str]) -> None:
        """verl's trainer sleeps the replicas after each generation (`free_cache_engine`)
        and calls this on every rank before `update_weights` (tags ["weights"]) and after
        it (["kv_cache"]). A sleeping shard refuses new weights, so the leader rank of each
        replica wakes that replica's shards, its share of its own node's (`node_replica`);
        waking an awake shard is a no-op."""
        if not self.is_leader_rank:
            return None
        import aiohttp

        from dynamod.integrations.verl import engine

        replica, replicas = node_replica(self.rank, self.replica_world,
                                         int(os.environ.get("WORLD_SIZE", "1")),
                                         local_world_size())  # fmt: skip
        async with aiohttp.ClientSession() as session:
            answers = await engine.replica_call(
                session, self.state_dir, replica, replicas, "wake_up"
            )
        log.info("verl.resume", tags=tags, replica=self.replica_rank,
                 shards=[a["shard"] for a in answers])
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self, weights: Iterable[tuple[str, Any]], wire_format: str = "named_tensors",
        global_steps: int | None = None, **kwargs: Any,
    ) -> dict[str, Any] | None:
        if wire_format != "named_tensors":
            raise VerlIntegrationError(
                f"rollout 'dynamod' takes full named tensors, not {wire_format!r}: set "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        version = await self._version_of(global_steps)
        if self.colocated is not None:
            return await self.colocated.update(weights, version, self._origin(global_steps))
        if self.rank != 0:
            for _ in weights:
                pass
            return None
        return await push_weights(
            self.state_dir, self.checkpoint_dir, weights, version,
            keep=self.settings.checkpoint_keep,
            origin=self._origin(global_steps),
            serving=self.settings.push_serving,
        )

    def _origin(self, global_steps: int | None) -> dict[str, Any]:
        return {"run": self.versions.run, "verl_step": global_steps}

    async def _version_of(self, global_steps: int | None) -> int:
        """The ledger version verl's step becomes (`versions.py`); no step: the next one."""
        from dynamod.client import Client

        status = await asyncio.to_thread(Client(self.state_dir).policy_status)
        current = int(status["current"])
        if global_steps is None:
            return current + 1
        return self.versions.version(global_steps, current, bool(status.get("initial")))


async def push_weights(
    state_dir: Path, root: Path, weights: Iterable[tuple[str, Any]], step: int | None,
    keep: int = 2, origin: dict[str, Any] | None = None, serving: int | None = None,
) -> dict[str, Any]:
    """Write `weights` as version `step` (default: the ledger's next) and push it;
    `origin` (verl's run and step) is recorded with it; `serving`: the push answers once
    that many shards serve it (`policy push --serving`)."""
    from dynamod.client import Client

    client = Client(state_dir)
    if step is None:
        step = int((await asyncio.to_thread(client.policy_status))["current"]) + 1
    path = await asyncio.to_thread(checkpoint.write_checkpoint, weights, root, step, origin)
    answer: dict[str, Any] = await asyncio.to_thread(
        functools.partial(client.policy_push, step, path, serving=serving)
    )
    await asyncio.to_thread(checkpoint.prune, root, keep, step)
    await asyncio.to_thread(updates.log_update, state_dir,
                            updates.push_record(step, origin, answer, path))
    log.info(
        "verl.weights_pushed", step=step, path=str(path), seconds=answer.get("seconds"),
        acks={k: v.get("total_ms", v.get("error")) for k, v in answer.get("acks", {}).items()},
        stale=answer.get("stale"),
    )
    return answer
