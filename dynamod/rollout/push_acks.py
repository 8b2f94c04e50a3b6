"""A push's shard updates and their acknowledgements as they arrive, so its answer can go
once enough serve.

A push with `serving = K` answers the trainer once K of the node's shards serve the new
step; the other shards' updates start after the answer, in the background, and are
collected the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

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


_Start = Callable[[], Coroutine[Any, Any, ShardAck]]  # what starts one shard's update


class Updates:
    """A push's shard updates (`starts`: shard -> what starts its update), started in
    order. With `first` = K (a push answered once K shards serve the step) the first K
    start now and the rest wait their turn, still serving, until `go()` (the answer's
    commit went through); each of those updating that fails before it lets the next
    waiting one start, so K stay on their way to the answer. A push that failed before its
    answer calls `drop()`, and the waiting ones never start. The rest updating beside the
    K used to share the node's cores with them: at 8 nodes x 32 shards the answer's shard
    took 131-152 ms to serve the step where one shard alone takes 68 (docs/benchmarks.md
    16)."""

    def __init__(self, starts: Mapping[str, _Start], first: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        # the waiting ones in their order, each with the event that starts it
        self._queue: list[tuple[asyncio.Task[ShardAck], asyncio.Event]] = []
        self.tasks: dict[asyncio.Task[ShardAck], str] = {}
        lead = len(starts) if first is None else first
        for index, (shard, start) in enumerate(starts.items()):
            if index < lead:
                task = loop.create_task(start())
                task.add_done_callback(self._updating_done)
            else:
                turn = asyncio.Event()
                task = loop.create_task(self._in_turn(turn, start))
                self._queue.append((task, turn))
            self.tasks[task] = shard

    @staticmethod
    async def _in_turn(turn: asyncio.Event, start: _Start) -> ShardAck:
        await turn.wait()
        return await start()

    def _start_next(self) -> None:
        if self._queue:
            task, turn = self._queue.pop(0)
            task.add_done_callback(self._updating_done)
            turn.set()

    def _updating_done(self, task: asyncio.Task[ShardAck]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._start_next()  # the answer needs another in its place

    @property
    def waiting(self) -> list[str]:
        """The shards whose turn has not come."""
        return sorted(self.tasks[t] for t, _ in self._queue)

    def go(self) -> None:
        while self._queue:
            self._start_next()

    def drop(self) -> None:
        """The push failed before its answer: the shards still waiting never start."""
        for task, _ in self._queue:
            task.cancel()
        self._queue.clear()
