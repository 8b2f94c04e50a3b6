"""The colocated weight update under dynamod: the trainer's own IPC transfer, then `publish`.

One update of step N from trainer rank r of `world` (verl calls `update_weights` on every
rank; rank r owns the admitted shards of its own node's dynamod whose index in name order
is r modulo `local_world`, the ranks on one node, so with colocated GPUs rank r feeds the
shard on its GPU, and a single trainer process feeds them all):

1. pause each owned shard (`pause_generation`, mode keep), as a disk update requires;
2. send the tensors over the transport (`ipc.WeightSender`) to every owned shard at once;
   rank 0 keeps a host copy on the way (the replay source);
3. `flush_cache` and `set_weight_version N` on every shard that acknowledged;
4. rank 0 writes the step's checkpoint (background by default), gathers every rank's
   acknowledgements (files under `<checkpoint_dir>/acks/step-N/`), and runs
   `policy publish N` with the checkpoint's path and each shard's digest: dynamod
   records it (how = "publish"), verifies, taints and resumes the shards, and holds the
   ones that missed it (no acknowledgement, other digest) to replay them from the file.

On a cluster stack every node's dynamod lists its own shards, so each node's ranks feed
that node's shards; acknowledgements name a shard as the ledger does (`<node>/<unit>`),
and the acks folder and the checkpoint must be on storage every node reads. The other
nodes' daemons follow the published step: a shard that already holds it (the step's
version and digest, from its own node's ranks) is verified, tainted and resumed without a
load; one that does not replays the checkpoint.

Every update appends one line to `<state_dir>/verl/updates.jsonl` (step, owned shards,
acknowledgements, what publish held, timings), which scripts/validate-gpu.sh judges.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from dynamod.integrations.verl import updates
from dynamod.integrations.verl.checkpoint import CheckpointWriter, HostCopy
from dynamod.integrations.verl.engine import call_route, claim_pause
from dynamod.integrations.verl.errors import EngineCallError, StackNotReadyError
from dynamod.integrations.verl.ipc import DEFAULT_BUCKET_BYTES, WeightSender, socket_address
from dynamod.integrations.verl.ranks import node_replica
from dynamod.integrations.verl.stack import Shard, StackView, read_stack

log = structlog.get_logger("dynamod.integrations.verl")

ACK_WAIT_S = 300.0
ACK_POLL_S = 0.05  # rank 0 looks for the other ranks' acknowledgement files this often


@dataclass
class ColocatedSync:
    """One trainer rank's side of the colocated path, kept for the whole run."""

    state_dir: Path
    checkpoint_dir: Path
    ipc_dir: Path
    rank: int = 0
    world: int = 1
    local_world: int = 0  # trainer ranks on this node (0: all `world` of them)
    keep: int = 2
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    background_write: bool = True
    timeout_s: float = 120.0
    writer: CheckpointWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = CheckpointWriter(self.checkpoint_dir, self.keep)

    def owned(self, shards: Iterable[Shard]) -> list[Shard]:
        """This rank's share of its node's shards (ranks are numbered node after node, as
        verl's worker groups and torchrun number them)."""
        mine, ranks_here = node_replica(self.rank, 1, self.world, self.local_world)
        ordered = sorted(shards, key=lambda s: s.name)
        return [s for i, s in enumerate(ordered) if i % ranks_here == mine]

    async def update(self, weights: Iterable[tuple[str, Any]], step: int,
                     origin: dict[str, Any] | None = None) -> dict[str, Any]:
        started = time.monotonic()
        view = read_stack(self.state_dir)
        errors: dict[str, str] = {}
        targets, addresses = self._receivers(view, step, errors)
        copy = HostCopy() if self.rank == 0 else None
        acks, sender, send_s = await self._deliver(targets, addresses, weights, step, copy,
                                                   errors)
        acks = {view.ledger_name(name): digest for name, digest in acks.items()}
        errors = {view.ledger_name(name): error for name, error in errors.items()}
        if self.rank != 0:
            self._leave_acks(step, acks, errors)
            return {"step": step, "acks": acks, "errors": errors}
        assert copy is not None
        written_at = time.monotonic()
        if self.background_write:
            path = await asyncio.to_thread(self.writer.submit, copy.tensors, step)
        else:
            path = await asyncio.to_thread(self.writer.write, copy.tensors, step)
        write_stall_s = time.monotonic() - written_at
        gathered_at = time.monotonic()
        acks.update(await self._gather_acks(step, errors))
        acks_wait_s = time.monotonic() - gathered_at
        from dynamod.client import Client

        published = await asyncio.to_thread(
            Client(self.state_dir).policy_publish, step, path, acks=acks
        )
        record = {
            "step": step,
            **(origin or {}),
            "shards": sorted(view.ledger_name(s.name) for s in view.admitted),
            "acks": acks,
            "errors": errors,
            "stale": published.get("stale", []),
            "behind": published.get("behind", []),  # other nodes' shards not at the step
            "digest": published.get("digest"),
            "checkpoint": str(path),
            "background_write": self.background_write,
            "bytes": sender.bytes_sent,
            "buckets": sender.buckets,
            "send_s": round(send_s, 3),
            "host_copy_s": round(copy.seconds, 3),
            "write_stall_s": round(write_stall_s, 3),
            "acks_wait_s": round(acks_wait_s, 3),  # for the other ranks' acknowledgements
            "seconds": round(time.monotonic() - started, 3),
        }
        updates.log_update(self.state_dir, record)
        log.info("verl.colocated_update", **{k: v for k, v in record.items() if k != "acks"})
        return {**record, "publish": published}

    def _receivers(self, view: StackView, step: int,
                   errors: dict[str, str]) -> tuple[list[Shard], dict[str, str]]:
        """This rank's admitted shards that have a weight receiver, and every owned shard's
        receiver address; a shard without one goes into `errors`."""
        targets = self.owned(view.admitted)
        if not targets and self.rank == 0:
            raise StackNotReadyError(
                f"no admitted rollout shard to update to step {step}: "
                f"{[(s.name, s.state) for s in view.shards]}"
            )
        addresses = {s.name: socket_address(self.ipc_dir, s.name) for s in targets}
        listening = {n for n, a in addresses.items() if Path(a.removeprefix("ipc://")).exists()}
        if targets and not listening:
            raise StackNotReadyError(
                f"weight_sync=ipc, but no shard of stack {view.stack!r} has a weight receiver "
                f"in {self.ipc_dir} (looked for {sorted(addresses.values())}): run the shards "
                "with dynamod's worker extension (stack vars worker_extension_cls and "
                "weight_ipc_dir; set in units/stacks/verl-cpu.toml and units/dynamo-vllm.toml), "
                "or set engine_kwargs.dynamod.ipc_dir to their weight_ipc_dir"
            )
        for name in sorted(set(addresses) - listening):
            errors[name] = f"no weight receiver at {addresses[name]}"
        return [s for s in targets if s.name in listening], addresses

    async def _deliver(
        self, targets: list[Shard], addresses: dict[str, str],
        weights: Iterable[tuple[str, Any]], step: int, copy: HostCopy | None,
        errors: dict[str, str],
    ) -> tuple[dict[str, Any], WeightSender, float]:
        """Pause `targets`, send them the weights, flush their KV cache and set their
        version: each shard that went through all of it, with its digest; the sender; the
        send's seconds."""
        await claim_pause(self.state_dir, targets, f"verl rank {self.rank}: IPC update to "
                                                   f"step {step}")  # fmt: skip
        async with aiohttp.ClientSession() as session:
            paused = await self._each(session, targets, "pause_generation", {"mode": "keep"},
                                      errors)
            sender = WeightSender([addresses[s.name] for s in paused], self.bucket_bytes,
                                  self.timeout_s)
            sent_at = time.monotonic()
            by_address = await asyncio.to_thread(sender.send, weights, step, copy)
            send_s = time.monotonic() - sent_at
            for name, address in addresses.items():
                if address in sender.errors:
                    errors[name] = sender.errors[address]
            acked = [s for s in paused if addresses[s.name] in by_address]
            for route, body in (("flush_cache", {}), ("set_weight_version",
                                                      {"weight_version": step})):
                acked = await self._each(session, acked, route, body, errors)
        return {s.name: by_address[addresses[s.name]].get("digest") for s in acked}, sender, send_s

    async def _each(self, session: aiohttp.ClientSession, shards: list[Shard], route: str,
                    body: dict[str, Any], errors: dict[str, str]) -> list[Shard]:
        """`route` on every shard; the ones that answered ok (others' errors kept)."""
        results = await asyncio.gather(*(call_route(session, s, route, body) for s in shards),
                                       return_exceptions=True)
        good = []
        for shard, result in zip(shards, results, strict=True):
            if isinstance(result, EngineCallError):
                errors[shard.name] = str(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                good.append(shard)
        return good

    def _ack_dir(self, step: int) -> Path:
        return self.checkpoint_dir / "acks" / f"step-{step}"

    def _leave_acks(self, step: int, acks: dict[str, str | None], errors: dict[str, str]
                    ) -> None:
        folder = self._ack_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".rank{self.rank}.json.partial"
        partial.write_text(json.dumps({"acks": acks, "errors": errors}))
        partial.rename(folder / f"rank{self.rank}.json")

    async def _gather_acks(self, step: int, errors: dict[str, str]) -> dict[str, str | None]:
        """The other ranks' acknowledgements; a rank that never reports counts as none."""
        if self.world == 1:
            return {}
        folder = self._ack_dir(step)
        deadline = time.monotonic() + ACK_WAIT_S
        acks: dict[str, str | None] = {}
        waiting = set(range(1, self.world))
        while waiting and time.monotonic() < deadline:
            for rank in sorted(waiting):
                file = folder / f"rank{rank}.json"
                if file.exists():
                    data = json.loads(file.read_text())
                    acks.update(data["acks"])
                    errors.update(data["errors"])
                    waiting.discard(rank)
            if waiting:
                await asyncio.sleep(ACK_POLL_S)
        for rank in waiting:
            errors[f"rank{rank}"] = f"no acknowledgement file within {ACK_WAIT_S:g}s"
        shutil.rmtree(folder, ignore_errors=True)
        return acks

    def close(self) -> None:
        self.writer.close()
