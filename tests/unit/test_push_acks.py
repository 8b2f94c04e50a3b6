"""A push's updates and acknowledgements as they arrive (dynamod/rollout/push_acks.py): the
answer can go once `want` shards acknowledged, the rest still running; with `first` = K the
rest start only after the answer (or once one of the K failed)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dynamod.rollout.push_acks import Updates, collect
from dynamod.rollout.shard_driver import ShardAck


class Refused(Exception):
    pass


async def shard(name: str, delay: float, fail: type[Exception] | None = None) -> ShardAck:
    await asyncio.sleep(delay)
    if fail is not None:
        raise fail(f"{name} refused")
    return ShardAck(name, 7, "d")


def tasks(*specs: tuple[str, float, type[Exception] | None]) -> dict[asyncio.Task[ShardAck], str]:
    return {asyncio.ensure_future(shard(*s)): s[0] for s in specs}


def test_answers_once_want_acknowledged_and_leaves_the_rest_running() -> None:
    async def run() -> None:
        running = tasks(("a", 0.0, None), ("b", 0.05, Refused), ("c", 5.0, None))
        acks = await collect(running, 1, Refused)
        assert [a.shard for a in acks.good] == ["a"] and not acks.bad
        assert sorted(acks.pending.values()) == ["b", "c"]
        assert not any(t.done() for t in acks.pending)  # not cancelled: they go on
        rest = await collect({t: n for t, n in acks.pending.items() if n == "b"}, 1, Refused)
        assert rest.good == [] and rest.bad == {"b": "b refused"} and not rest.pending
        for t in acks.pending:
            t.cancel()

    asyncio.run(run())


def test_failures_do_not_count_and_every_task_ends_when_too_few_can_acknowledge() -> None:
    async def run() -> None:
        acks = await collect(
            tasks(("a", 0.0, Refused), ("b", 0.01, None), ("c", 0.02, Refused)), 2, Refused
        )
        assert [a.shard for a in acks.good] == ["b"]
        assert sorted(acks.bad) == ["a", "c"] and not acks.pending

    asyncio.run(run())


def test_an_unexpected_error_cancels_the_rest_and_is_raised() -> None:
    async def run() -> list[asyncio.Task[ShardAck]]:
        running = tasks(("a", 0.0, RuntimeError), ("b", 5.0, None))
        with pytest.raises(RuntimeError, match="a refused"):
            await collect(running, 2, Refused)
        await asyncio.sleep(0)
        return list(running)

    finished = asyncio.run(run())
    assert finished[1].cancelled()


def test_want_of_every_task_waits_for_all() -> None:
    async def run() -> None:
        acks = await collect(tasks(("b", 0.02, None), ("a", 0.01, None)), 2, Refused)
        assert sorted(a.shard for a in acks.good) == ["a", "b"] and not acks.pending

    asyncio.run(run())


class _Log:
    """Stands in for the shards' engine calls: each records when it begins and ends."""

    def __init__(self, *fail: str) -> None:
        self.events: list[tuple[str, str]] = []
        self.fail = set(fail)

    async def update(self, name: str) -> ShardAck:
        self.events.append(("begin", name))
        await asyncio.sleep(0.02)
        self.events.append(("end", name))
        if name in self.fail:
            raise Refused(f"{name} refused")
        return ShardAck(name, 7, "d")

    def starts(self, *names: str) -> dict[str, Callable[[], Coroutine[Any, Any, ShardAck]]]:
        return {n: functools.partial(self.update, n) for n in names}

    def began(self) -> list[str]:
        return [n for what, n in self.events if what == "begin"]

    def most_at_once(self) -> int:
        """The most updates running together."""
        running = most = 0
        for what, _ in self.events:
            running += 1 if what == "begin" else -1
            most = max(most, running)
        return most


def test_the_answer_s_shards_update_alone_and_the_rest_start_at_go() -> None:
    """`serving = 1` of three: only the first updates until the answer's commit (`go`);
    the two it would have shared the cores with start then."""

    async def run() -> None:
        log = _Log()
        updates = Updates(log.starts("a", "b", "c"), first=1)
        acks = await collect(updates.tasks, 1, Refused)
        assert [a.shard for a in acks.good] == ["a"] and log.began() == ["a"]
        assert updates.waiting == ["b", "c"] and sorted(acks.pending.values()) == ["b", "c"]
        await asyncio.sleep(0.05)
        assert log.began() == ["a"], "the rest waited for the answer"
        updates.go()
        rest = await collect(acks.pending, 2, Refused)
        assert sorted(a.shard for a in rest.good) == ["b", "c"] and updates.waiting == []
        assert log.began() == ["a", "b", "c"]

    asyncio.run(run())


def test_a_failed_first_shard_lets_the_next_one_start_for_the_answer() -> None:
    """One of the K failed: the next waiting shard starts in its place, the others still
    wait their turn (they would share the cores with it)."""

    async def run() -> None:
        log = _Log("a")
        updates = Updates(log.starts("a", "b", "c", "d"), first=1)
        acks = await collect(updates.tasks, 1, Refused)
        assert acks.bad == {"a": "a refused"} and [g.shard for g in acks.good] == ["b"]
        assert log.began() == ["a", "b"] and updates.waiting == ["c", "d"]
        updates.go()
        rest = await collect(acks.pending, 2, Refused)
        assert sorted(g.shard for g in rest.good) == ["c", "d"]

    asyncio.run(run())


def test_each_failure_starts_one_more_until_k_acknowledge_or_none_is_left() -> None:
    async def run() -> None:
        log = _Log("a", "b", "d")
        updates = Updates(log.starts("a", "b", "c", "d", "e"), first=2)
        acks = await collect(updates.tasks, 2, Refused)
        # a and b failed together: c and d took their places, d failed: e took its
        assert sorted(acks.bad) == ["a", "b", "d"], acks
        assert sorted(g.shard for g in acks.good) == ["c", "e"] and updates.waiting == []
        assert log.began()[:2] == ["a", "b"] and sorted(log.began()) == ["a", "b", "c", "d", "e"]
        assert log.most_at_once() == 2, log.events

        log = _Log("a", "b", "c")
        updates = Updates(log.starts("a", "b", "c"), first=1)
        acks = await collect(updates.tasks, 1, Refused)
        assert sorted(acks.bad) == ["a", "b", "c"] and not acks.good and not acks.pending
        assert log.most_at_once() == 1

    asyncio.run(run())


def test_a_push_failed_before_its_answer_never_starts_the_waiting() -> None:
    async def run() -> None:
        log = _Log()
        updates = Updates(log.starts("a", "b", "c"), first=1)
        acks = await collect(updates.tasks, 1, Refused)
        updates.drop()  # the ledger's write failed, say
        ended = await asyncio.gather(*acks.pending, return_exceptions=True)
        assert all(isinstance(e, asyncio.CancelledError) for e in ended), ended
        assert log.began() == ["a"]
        updates.go()  # too late: nothing starts
        await asyncio.sleep(0.03)
        assert log.began() == ["a"]

    asyncio.run(run())


def test_without_first_every_shard_starts_at_once() -> None:  # a push without `serving`
    async def run() -> None:
        log = _Log()
        updates = Updates(log.starts("a", "b", "c"))
        await asyncio.sleep(0.005)
        assert log.began() == ["a", "b", "c"] and updates.waiting == []
        acks = await collect(updates.tasks, 3, Refused)
        assert len(acks.good) == 3

    asyncio.run(run())
