"""A first-come-first-served line for bounded work on a node: how many of its units may be
starting at once (`[stack] max_starting`, core/engine.py) and how many of its shards may
be applying a policy update at once (`[policy] max_updating`, rollout/policy.py).

A start is the stretch from spawn until the unit's readiness probe passes (or it stayed up
`min_uptime`; a oneshot until it exits). What runs after (a rollout shard's replay) has no
deadline and may wait on others, so it holds no slot. Every start on a node shares its cores:
with more starts at once than the cores can carry, each one gets slower, a readiness deadline
that a lone start meets is missed by all of them, they are killed and start again together,
and none ever gets ready. A limit makes the rest wait their turn, before the spawn, so the
wait does not count against their deadline.

Slots are handed out first come, first served. Pure asyncio, no OS: tests/unit drives it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Slots:
    """At most `limit` holders at once (None: no limit). `take` waits its turn in order of
    arrival; `give_back` frees a slot. A limit lowered below the holders now lets them finish
    and hands out no slot until they are below it; a limit raised wakes the waiting."""

    def __init__(
        self, limit: int | None, setting: str = "max_starting", doing: str = "starting"
    ) -> None:
        self.limit = limit
        self.setting, self.doing = setting, doing  # the limit's name, what holders do
        self.holders: list[str] = []  # in the order they took their slot
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> list[str]:
        return [name for name, future in self._waiting if not future.done()]

    def would_wait(self) -> bool:
        """Whether a `take` now would wait: no slot free, or others ahead of it."""
        return not self._free() or bool(self.waiting)

    def describe(self) -> str:
        """Who holds the slots, for a waiting unit's detail."""
        holders = ", ".join(self.holders) or "none"
        return f"{len(self.holders)} of {self.setting} {self.limit} {self.doing}: {holders}"

    def as_dict(self) -> dict[str, Any]:
        """`start_slots` (`update_slots`) in `status --json`."""
        return {self.setting: self.limit, self.doing: list(self.holders),
                "waiting": self.waiting}  # fmt: skip

    async def take(self, name: str) -> None:
        if not self.would_wait():
            self.holders.append(name)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((name, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as the cancel came
                self.give_back(name)
            else:
                self._waiting = deque(w for w in self._waiting if w[1] is not future)
            raise

    def give_back(self, name: str) -> None:
        """Free `name`'s slot (nothing if it holds none) and hand it to the next in line."""
        if name in self.holders:
            self.holders.remove(name)
            self._hand_out()

    def set_limit(self, limit: int | None) -> None:
        self.limit = limit
        self._hand_out()

    def _free(self) -> bool:
        return self.limit is None or len(self.holders) < self.limit

    def _hand_out(self) -> None:
        while self._waiting and self._free():
            name, future = self._waiting.popleft()
            if future.done():  # its taker was cancelled
                continue
            self.holders.append(name)
            future.set_result(None)
