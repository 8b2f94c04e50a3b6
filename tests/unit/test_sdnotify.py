"""dynamod.ops.sdnotify: what goes into STATUS=, when the watchdog is ours, engine faults."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynamod.core.phase import Phase
from dynamod.core.state import UnitState
from dynamod.ops import sdnotify


def test_status_line_counts_ready_units_and_names_the_others() -> None:
    units = [
        ("etcd", UnitState.READY),
        ("init", UnitState.COMPLETED),
        ("worker@0", UnitState.READY),
        ("worker@1", UnitState.BACKOFF),
    ]
    assert sdnotify.status_line("rollout", Phase.UP, units) == "3/4 units ready; worker@1 backoff"
    assert sdnotify.status_line("rollout", Phase.UP, units[:3]) == "3/3 units ready"
    assert sdnotify.status_line("rollout", Phase.STARTING, units) == (
        "stack rollout starting: 3/4 units ready; worker@1 backoff"
    )


def test_a_degraded_status_line_says_why_each_unit_is_not_ready() -> None:
    units = [("etcd", UnitState.READY), ("worker@0", UnitState.WAITING)]
    line = sdnotify.status_line("rollout", Phase.DEGRADED, units,
                                {"worker@0": "waiting for etcd (ready)"})
    assert line == ("stack rollout degraded: 1/2 units ready;"
                    " worker@0 waiting (waiting for etcd (ready))")


def test_status_line_stays_one_short_line_for_big_stacks() -> None:
    units = [(f"worker@{i}", UnitState.STARTING) for i in range(64)]
    line = sdnotify.status_line("big", Phase.STARTING, units)
    assert line.endswith("worker@3 starting (+60 more)")
    assert "\n" not in line and len(line) < 200


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "400000"}, 0.2),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another pid
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_and_only_for_us(
    environ: dict[str, str], interval: float | None
) -> None:
    assert sdnotify.watchdog_interval(environ, pid=4242) == interval


def test_notify_sends_one_datagram(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        assert sdnotify.notify("READY=1\nSTATUS=ok", str(path))
        assert receiver.recv(100) == b"READY=1\nSTATUS=ok"
    assert not sdnotify.notify("READY=1", "")  # not under systemd: nothing sent
    assert not sdnotify.notify("READY=1", str(tmp_path / "gone.sock"))


async def test_a_crashed_lifecycle_task_is_an_engine_fault() -> None:
    async def crash() -> None:
        raise RuntimeError("bug")

    async def forever() -> None:
        await asyncio.Event().wait()

    running = asyncio.ensure_future(forever())
    cancelled = asyncio.ensure_future(forever())
    crashed = asyncio.ensure_future(crash())
    cancelled.cancel()
    await asyncio.wait([crashed, cancelled])
    units = {
        "etcd": SimpleNamespace(name="etcd", task=running),
        "nats": SimpleNamespace(name="nats", task=cancelled),
        "idle": SimpleNamespace(name="idle", task=None),
    }
    assert sdnotify.engine_fault(SimpleNamespace(units=units)) is None  # type: ignore[arg-type]
    units["worker"] = SimpleNamespace(name="worker", task=crashed)
    fault = sdnotify.engine_fault(SimpleNamespace(units=units))  # type: ignore[arg-type]
    assert fault == "lifecycle task of worker died: RuntimeError('bug')"
    running.cancel()
