"""A push's shard acknowledgements as they arrive, so its answer can go once enough serve.

A push with `serving = K` answers the trainer once K of the node's shards serve the new
step; the other shards' updates go on after the answer, in the background, and are
collected the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamod.rollout.shard_driver import ShardAck


@dataclass
class Acks:
    """What a push's shards said so far: acknowledged (`good`), failed (`bad`: shard ->
    why), and the updates still running (`pending`: task -> shard)."""

    good: list[ShardAck] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    pending: dict[asyncio.Task[ShardAck], str] = field(default_factory=dict)


async def collect(
    tasks: Mapping[asyncio.Task[ShardAck], str],
    want: int,
    failure: type[Exception],
) -> Acks:
    """Wait on the shards' update `tasks` (task -> shard) until `want` of them acknowledged
    or every one ended. A task that raised `failure` is a failed shard; anything else it
    raised cancels the tasks still running and is raised. Cancelled itself, it cancels
    them too."""
    acks = Acks(pending=dict(tasks))
    try:
        while acks.pending and len(acks.good) < want:
            done, _ = await asyncio.wait(acks.pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: acks.pending[t]):  # in a stable order
                shard = acks.pending.pop(task)
                error = task.exception()
                if error is None:
                    acks.good.append(task.result())
                elif isinstance(error, failure):
                    acks.bad[shard] = str(error)
                else:
                    raise error
    except BaseException:
        for task in acks.pending:
            task.cancel()
        raise
    return acks
