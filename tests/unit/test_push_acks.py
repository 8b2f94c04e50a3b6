"""A push's acknowledgements as they arrive (dynamod/rollout/push_acks.py): the answer
can go once `want` shards acknowledged, the rest still running."""

from __future__ import annotations

import asyncio

import pytest

from dynamod.rollout.push_acks import collect
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
