"""The CPU worker's mocker presence endpoint (PRESENCE_ENDPOINT): an end of it while the
worker runs is logged, since each new engine then waits Dynamo's 100 ms again; its end at
close is not. That new engines serve at once with it is shown on a real worker behind the
real frontend (tests/integration/test_cpu_worker.py, the flushes test)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dynamod.workers.cpu.mocker import PRESENCE_ENDPOINT, MockerEngine


def engine() -> MockerEngine:
    return MockerEngine("model", "tiny", {}, lambda _error: None)


async def test_a_presence_that_stops_while_the_worker_runs_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mocker = engine()
    mocker._client_runtime = object()  # open, as `start` leaves it
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ended.set_exception(RuntimeError("request plane gone"))
    with caplog.at_level(logging.WARNING, logger="dynamod.workers.cpu"):
        mocker._presence_ended(ended)
    (record,) = caplog.records
    assert PRESENCE_ENDPOINT in record.getMessage()
    assert "request plane gone" in record.getMessage()
    assert "waits 100 ms" in record.getMessage()


async def test_a_presence_ended_by_close_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    mocker = engine()  # closed: no client runtime
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ended.set_result(None)
    cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cancelled.cancel()
    with caplog.at_level(logging.WARNING, logger="dynamod.workers.cpu"):
        mocker._presence_ended(ended)
        mocker._client_runtime = object()
        mocker._presence_ended(cancelled)
    assert caplog.records == []
