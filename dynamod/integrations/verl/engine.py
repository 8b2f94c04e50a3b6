"""verl's lifecycle calls as the shards' engine routes (dynamo.vllm's `/engine/<route>`).

| verl (RolloutReplica / server)  | route on each of the replica's shards      |
|---------------------------------|--------------------------------------------|
| sleep                           | control/sleep {"level": 1}                 |
| wake_up                         | control/wake_up {}                         |
| clear_kv_cache, release_kv_cache| flush_cache {}                             |
| abort_all_requests              | pause_generation {"mode": "abort"}         |
| resume_generation               | resume_generation {}                       |

The system URLs come from dynamod's status (re-read for every fan-out, so a restarted
shard is addressed where it is now). A held shard is skipped: dynamod has it paused
while it replays the current weights, and resuming it from here would admit it early.
An answer other than `{"status": "ok"}` is an EngineCallError naming shard and route.

A pause made here (`abort_all_requests`, and a rank's pause before its IPC update) is
claimed with the node's dynamod first and released after `resume_generation`: dynamod
shows who holds the shard paused, and rejoins it if this process exits first
(rollout/pause_claims.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from dynamod.integrations.verl.errors import EngineCallError
from dynamod.integrations.verl.stack import Shard, read_stack

log = structlog.get_logger("dynamod.integrations.verl")

LIFECYCLE_ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "sleep": ("control/sleep", {"level": 1}),
    "wake_up": ("control/wake_up", {}),
    "clear_kv_cache": ("flush_cache", {}),
    "release_kv_cache": ("flush_cache", {}),
    "abort_all_requests": ("pause_generation", {"mode": "abort"}),
    "resume_generation": ("resume_generation", {}),
}


@dataclass(frozen=True)
class EngineAnswer:
    shard: str
    route: str
    body: dict[str, Any]


async def call_route(
    session: aiohttp.ClientSession, shard: Shard, route: str, body: dict[str, Any],
    timeout: float = 120.0,
) -> EngineAnswer:
    if shard.system_url is None:
        raise EngineCallError(f"{shard.name}: no system URL in dynamod's status")
    url = f"{shard.system_url}/engine/{route}"
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            answer = await r.json(content_type=None)
            status = r.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise EngineCallError(f"{shard.name}: POST {url} failed: {exc}") from None
    if status != 200 or not isinstance(answer, dict) or answer.get("status") != "ok":
        raise EngineCallError(f"{shard.name}: POST {url} answered HTTP {status}: {answer!r}")
    return EngineAnswer(shard.name, route, answer)


async def fan_out(
    session: aiohttp.ClientSession, shards: Sequence[Shard], call: str
) -> list[EngineAnswer]:
    """verl's `call` on every admitted shard in `shards`, in parallel."""
    route, body = LIFECYCLE_ROUTES[call]
    targets = [s for s in shards if s.admitted]
    skipped = [s.name for s in shards if not s.admitted]
    if skipped:
        log.info("verl.lifecycle_skipped_held", call=call, shards=skipped)
    answers = await asyncio.gather(*(call_route(session, s, route, body) for s in targets))
    log.info("verl.lifecycle", call=call, route=route, shards=[a.shard for a in answers])
    return list(answers)


async def claim_pause(state_dir: Path, shards: Sequence[Shard], why: str) -> None:
    """Claim, as this process, the pause of `shards` about to be made. A claim dynamod
    refuses (a daemon too old to know claims, a caller in another pid namespace) is
    logged and the pause made anyway, unwatched, as before claims."""
    if shards:
        await _claims(state_dir, "policy_pause", [s.name for s in shards], why)


async def release_pause(state_dir: Path, shards: Sequence[Shard]) -> None:
    if shards:
        await _claims(state_dir, "policy_release", [s.name for s in shards])


async def _claims(state_dir: Path, call: str, *args: Any) -> None:
    from dynamod.client import Client
    from dynamod.core.errors import DaemonError

    try:
        await asyncio.to_thread(getattr(Client(state_dir), call), *args)
    except DaemonError as exc:
        log.warning("verl.pause_claim_failed", call=call, shards=args[0], error=str(exc))


async def replica_call(
    session: aiohttp.ClientSession, state_dir: Path, replica_rank: int, replicas: int,
    call: str,
) -> list[dict[str, Any]]:
    """verl's `call` on the shards replica `replica_rank` of `replicas` owns on the node of
    the daemon at `state_dir`, read afresh; each answer names its shard as the ledger does
    (`<node>/<unit>` on a cluster)."""
    view = await asyncio.to_thread(read_stack, state_dir)
    shards = view.shards_of_replica(replica_rank, replicas)
    if call == "abort_all_requests":  # a pause: verl resumes it after its update
        admitted = [s for s in shards if s.admitted]
        await claim_pause(state_dir, admitted, f"verl replica {replica_rank}: {call}")
    answers = await fan_out(session, shards, call)
    if call == "resume_generation":  # every shard of the replica, admitted since or not
        await release_pause(state_dir, shards)
    return [{"shard": view.ledger_name(a.shard), "route": a.route, **a.body} for a in answers]
