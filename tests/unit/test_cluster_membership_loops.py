"""The membership's background loops (pure asyncio, no etcd): a CancelledError that is no
cancel of the loop's task (gRPC raises one in a call whose channel another call closed) is a
failed round, not the loop's end; a loop that ends anyway is logged and started again; a
real cancel (stop) ends them for good."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from dynamod.cluster import membership
from dynamod.cluster.membership import Membership
from dynamod.core.placement import ClusterSpec

SPEC = ClusterSpec(nodes={"head": "10.1.0.1"}, head="head", node="head",
                   registry=["http://10.1.0.1:2379"])  # fmt: skip


def _membership() -> Membership:
    return Membership(SPEC, registrations=Any, policy=None)  # type: ignore[arg-type]


class _ClosedUnderCalls:
    """Stands in for the etcd client: its first reads fail as gRPC fails a call whose
    channel another call closed (a bare CancelledError), then it answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.reads = 0

    async def get_prefix(self, prefix: str) -> list[Any]:
        self.reads += 1
        if self.reads <= self.failures:
            raise asyncio.CancelledError
        return []


async def test_a_stray_cancelled_error_is_a_failed_round_and_a_stop_still_ends_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "READ_FALLBACK_S", 0.01)
    member = _membership()
    member.daemon = SimpleNamespace(stack=SimpleNamespace(name="s"), phase="up")  # type: ignore[assignment]
    etcd = _ClosedUnderCalls(failures=3)
    member.etcd = etcd  # type: ignore[assignment]
    with capture_logs() as logs:
        task = asyncio.get_running_loop().create_task(member._read_loop())
        await asyncio.sleep(0.2)
        assert not task.done() and etcd.reads > 3, "the loop must go on after those rounds"
        task.cancel()  # a real cancel (stop) ends it
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
    failed = [e for e in logs if e["event"] == "cluster.registry_unreachable"]
    assert len(failed) == 1 and "read: CancelledError" in failed[0]["error"], failed


async def test_a_loop_that_ends_is_logged_and_started_again_until_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "LOOP_RESTART_S", 0.01)
    member = _membership()
    starts = 0

    async def dies_once() -> None:
        nonlocal starts
        starts += 1
        if starts == 1:
            raise RuntimeError("a bug")
        await asyncio.Event().wait()

    with capture_logs() as logs:
        member._spawn("cluster-test", dies_once)
        await asyncio.sleep(0.1)
        assert starts == 2 and len(member._tasks) == 1 and not member._tasks[0].done()
        await member.stop()
        await asyncio.sleep(0.05)
    assert starts == 2 and not member._tasks
    ended = [e for e in logs if e["event"] == "cluster.loop_ended"]
    assert len(ended) == 1 and "a bug" in ended[0]["why"], ended
