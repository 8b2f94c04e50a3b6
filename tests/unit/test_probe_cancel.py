"""A stop's cancel is never swallowed by a probe attempt that finishes at that moment.
Python 3.11's `asyncio.wait_for` returns the inner result when the inner task is done as
the outer one is cancelled; a `down` landing then was lost and the unit kept restarting."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from dynamod.core.probes import timed
from dynamod.core.spec import TcpProbe

SPEC = TcpProbe(kind="tcp", port=1, timeout=1)
Attempt = Coroutine[Any, Any, tuple[bool, str]]


async def cancelled_as_it_answers(run: Callable[[Attempt], Awaitable[Any]]) -> Any:
    """Run `run(attempt)`, the stop's cancel arriving just as the attempt has its answer;
    returns "cancelled" if the cancel came through, else what `run` returned."""
    outer: asyncio.Task[Any] | None = None

    async def attempt() -> tuple[bool, str]:
        assert outer is not None
        outer.cancel()
        return True, "answered"

    outer = asyncio.ensure_future(run(attempt()))
    try:
        return await outer
    except asyncio.CancelledError:
        return "cancelled"


async def test_timed_passes_a_cancel_on_even_when_the_attempt_just_answered() -> None:
    assert await cancelled_as_it_answers(lambda attempt: timed(SPEC, attempt)) == "cancelled"


async def test_wait_for_as_used_before_swallows_it_so_the_check_can_fail() -> None:
    """The old code path, kept here as the control: on 3.11 the cancel is lost."""
    got = await cancelled_as_it_answers(lambda attempt: asyncio.wait_for(attempt, timeout=1))
    if got == "cancelled":
        pytest.skip("this Python's wait_for does not swallow the cancel (3.12+)")
    assert got == (True, "answered")
