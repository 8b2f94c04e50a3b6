"""`[policy] max_updating`: at most N of a node's shards applying an update at once. The
slots themselves are core's (test_start_slots.py); here the policy manager's use of them
(its engine calls replaced by a timed stand-in: pure asyncio, no process), the spec field,
the diff `apply` shows, and the status line. tests/integration/test_policy.py pushes
through them on real workers."""

from __future__ import annotations

import asyncio
import itertools
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.core import spec
from dynamod.core.errors import SpecErrors
from dynamod.core.spec import change
from dynamod.core.spec.diff import diff, lines
from dynamod.rollout import tables
from dynamod.rollout.policy import PolicyManager
from dynamod.rollout.policy_table import PolicySpec, policy_of
from dynamod.rollout.registrations import DynamoRegistrations
from dynamod.rollout.shard_driver import ShardAck

# ------------------------------------------------------------------ the policy manager


class _Engine:
    def __init__(self) -> None:
        self.details: dict[str, list[str]] = {}

    def set_detail(self, unit: Any, detail: str) -> None:
        unit.detail = detail
        self.details.setdefault(unit.name, []).append(detail)


def _service(limit: int | None) -> tuple[PolicyManager, _Engine, list[tuple[str, str]]]:
    """A policy manager whose `_apply` (the shard's engine calls) takes 20 ms and records
    when each shard's update begins and ends."""
    service = PolicyManager(PolicySpec(shards=["worker"], max_updating=limit),
                            DynamoRegistrations())  # fmt: skip
    engine = _Engine()
    service.host = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    events: list[tuple[str, str]] = []

    async def _apply(unit: Any, target: Any) -> ShardAck:
        events.append(("begin", unit.name))
        await asyncio.sleep(0.02)
        events.append(("end", unit.name))
        return ShardAck(unit.name, 1, None, {"load": 20.0})

    service._apply = _apply  # type: ignore[method-assign]
    return service, engine, events


def _units(n: int, held: bool = False) -> list[Any]:
    return [SimpleNamespace(name=f"worker@{i}", detail="",
                            hold_reason="held: replaying" if held else None)
            for i in range(n)]  # fmt: skip


def _most_at_once(events: list[tuple[str, str]]) -> int:
    now = most = 0
    for what, _ in events:
        now += 1 if what == "begin" else -1
        most = max(most, now)
    return most


async def test_a_push_to_five_shards_with_max_updating_2_updates_two_at_once_in_order() -> None:
    service, engine, events = _service(2)
    units = _units(5)
    acks = await asyncio.gather(*(service.apply(u, None) for u in units))
    assert _most_at_once(events) == 2
    assert [name for what, name in events if what == "begin"] == [u.name for u in units]
    waited = [a.waited_ms for a in acks]
    assert waited[0] < 5 and waited[1] < 5  # the first two took a slot at once
    assert all(w >= 15 for w in waited[2:]), waited  # the rest waited for an update
    assert [a.as_dict()["waited_ms"] for a in acks] == [round(w, 1) for w in waited]
    assert engine.details == {}  # serving shards: their detail stays what it is
    assert service.update_slots.holders == [] and service.update_slots.waiting == []


async def test_without_the_limit_every_shard_updates_at_once() -> None:  # the control
    service, _, events = _service(None)
    acks = await asyncio.gather(*(service.apply(u, None) for u in _units(5)))
    assert _most_at_once(events) == 5 and all(a.waited_ms < 5 for a in acks)
    assert service.update_slots.limit is None


async def test_a_held_shard_in_line_says_so_and_status_lists_the_line() -> None:
    service, engine, _ = _service(1)
    units = _units(3, held=True)
    tasks = [asyncio.ensure_future(service.apply(u, None)) for u in units]
    await asyncio.sleep(0.005)
    assert service.update_slots.as_dict() == {
        "max_updating": 1, "updating": ["worker@0"], "waiting": ["worker@1", "worker@2"]
    }  # fmt: skip
    assert units[2].detail == ("held: replaying; waiting for an update slot (1 of max_updating 1 "
                               "updating: worker@0)")  # fmt: skip
    await asyncio.gather(*tasks)
    assert "worker@0" not in engine.details  # it did not wait
    assert units[2].detail == "held: replaying"  # its turn came: the wait is not shown on


async def test_a_failed_update_gives_its_slot_to_the_next() -> None:
    service, _, events = _service(1)
    real = service._apply

    async def broken_first(unit: Any, target: Any) -> ShardAck:
        if unit.name == "worker@0":
            raise RuntimeError("engine call failed")
        return await real(unit, target)

    service._apply = broken_first  # type: ignore[method-assign]
    first, second = (asyncio.ensure_future(service.apply(u, None)) for u in _units(2))
    with pytest.raises(RuntimeError):
        await first
    assert (await second).shard == "worker@1" and events == [("begin", "worker@1"),
                                                             ("end", "worker@1")]
    assert service.update_slots.holders == []


async def test_a_cancelled_wait_leaves_the_line() -> None:  # a shard that exited in line
    service, _, events = _service(1)
    first, second, third = (asyncio.ensure_future(service.apply(u, None)) for u in _units(3))
    await asyncio.sleep(0.005)
    second.cancel()
    await asyncio.gather(first, third)
    assert ("begin", "worker@1") not in events and service.update_slots.waiting == []


async def test_a_raised_limit_lets_the_waiting_update() -> None:
    service, _, events = _service(1)
    tasks = [asyncio.ensure_future(service.apply(u, None)) for u in _units(3)]
    await asyncio.sleep(0.005)
    service.update_slots.set_limit(3)  # what `restacked` does with the new table's
    await asyncio.gather(*tasks)
    assert _most_at_once(events) == 3


# ------------------------------------------------------------------ the spec field

STACK = """
    [units.worker]
    replicas = 2
    command = ["w"]
    ports = { system = 0 }
    dynamo = { system_url = "http://127.0.0.1:{ports.system}", etcd = "http://127.0.0.1:2", namespace = "t" }
    [policy]
    store = "file"
    shards = ["worker"]
"""  # noqa: E501


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(textwrap.dedent(text))
    return path


def _load(path: Path) -> spec.Stack:
    tables.register()
    ports = itertools.count(40000)
    return spec.load(path, state_dir=path.parent / "state", allocate_port=lambda: next(ports))


def _limit(stack: spec.Stack) -> int | None:
    policy = policy_of(stack)
    assert policy is not None
    return policy.max_updating


def test_max_updating_is_read_and_absent_means_no_limit(tmp_path: Path) -> None:
    assert _limit(_load(_write(tmp_path, STACK))) is None
    assert _limit(_load(_write(tmp_path, STACK + "    max_updating = 2\n"))) == 2


@pytest.mark.parametrize("bad", ["0", "-1", "257", "1.5", "true", "[2]", '"two"'])
def test_a_bad_max_updating_is_refused_naming_the_file_and_field(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, STACK + f"    max_updating = {bad}\n")
    with pytest.raises(SpecErrors) as info:
        _load(path)
    [error] = info.value.errors
    assert error.field == "policy.max_updating" and error.file == str(path)


def test_a_changed_max_updating_is_a_change_apply_shows(tmp_path: Path) -> None:
    running = _load(_write(tmp_path, STACK + "    max_updating = 1\n"))
    counter = itertools.count(50000)
    new = change.reread(_write(tmp_path, STACK), running, {},
                        allocate_port=lambda: next(counter))  # fmt: skip
    found = diff(running, new)
    assert found.tables == {"policy": {"max_updating": (1, None)}} and not found.changed
    assert lines(found, {}) == ["~ [policy] max_updating: 1 -> (unset)"]


# ------------------------------------------------------------------ status


def test_status_says_who_updates_and_who_waits_while_any_waits() -> None:
    from dynamod.control import render

    stack = {"stack": "s", "phase": "up", "daemon_pid": 1, "state_dir": "/x", "units": []}
    slots = {"max_updating": 1, "updating": ["worker@0"], "waiting": ["worker@1", "worker@2"]}
    table = render.status_table({**stack, "policy": {"update_slots": slots}})
    assert ("update slots: 1 of max_updating 1 in use (worker@0); waiting: worker@1, worker@2"
            in table)  # fmt: skip
    for quiet in ({**slots, "waiting": []}, None):  # nobody waits, or no limit: no line
        table = render.status_table({**stack, "policy": {"update_slots": quiet}})
        assert "update slots" not in table


def test_status_names_the_shards_a_push_answered_early_left_updating() -> None:
    from dynamod.control import render

    stack = {"stack": "s", "phase": "up", "daemon_pid": 1, "state_dir": "/x", "units": []}
    table = render.status_table(
        {**stack, "policy": {"current": 7, "updating": ["worker@1", "worker@2"]}}
    )
    assert ("policy v7: answered early, still updating (no trainer traffic until they serve "
            "it): worker@1, worker@2") in table  # fmt: skip
    for done in ([], None):
        assert "still updating" not in render.status_table(
            {**stack, "policy": {"current": 7, "updating": done}}
        )
