"""`[stack] max_starting`: the start slots (pure asyncio, no process), the spec field that
sets them, and the diff `apply` shows when it changes. The engine's use of them is in
test_engine.py (start slots)."""

from __future__ import annotations

import asyncio
import itertools
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.core import spec
from dynamod.core.errors import SpecError
from dynamod.core.slots import Slots
from dynamod.core.spec import change
from dynamod.core.spec.diff import StackDiff, diff, lines

# ------------------------------------------------------------------ the slots

# one step: ("take", name), ("give", name), ("cancel", name) or ("limit", n or None)
_NAMES = st.sampled_from("abcdefgh")
_STEP = st.one_of(
    st.tuples(st.just("take"), _NAMES),
    st.tuples(st.just("give"), _NAMES),
    st.tuples(st.just("cancel"), _NAMES),
    st.tuples(st.just("limit"), st.one_of(st.none(), st.integers(1, 4))),
)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(1, 4), steps=st.lists(_STEP, max_size=40))
def test_slots_never_grant_past_the_limit_and_go_in_order(
    start: int, steps: list[tuple[str, object]]
) -> None:
    """Against a model: a slot is granted only while fewer than `limit` hold one, to the
    longest waiting first; a cancelled wait leaves the line; a freed slot goes on at once."""

    async def main() -> None:
        slots = Slots(start)
        tasks: dict[str, asyncio.Task[None]] = {}
        line: list[str] = []  # the model: who waits, in order
        holders: list[str] = []
        limit: int | None = start

        def hand_out() -> None:
            while line and (limit is None or len(holders) < limit):
                holders.append(line.pop(0))

        for op, arg in steps:
            if op == "take" and arg not in tasks and arg not in holders:
                name = str(arg)
                tasks[name] = asyncio.ensure_future(slots.take(name))
                line.append(name)
                hand_out()
            elif op == "give" and arg in holders:
                slots.give_back(str(arg))
                holders.remove(str(arg))
                hand_out()
            elif op == "cancel" and arg in line:
                tasks[str(arg)].cancel()
                line.remove(str(arg))
            elif op == "limit":
                limit = arg if isinstance(arg, int) else None
                slots.set_limit(limit)
                hand_out()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            for name, task in list(tasks.items()):
                if task.done():
                    del tasks[name]
            assert slots.holders == holders, (op, arg)
            assert slots.waiting == line, (op, arg)
            full = limit is not None and len(holders) >= limit
            assert slots.would_wait() == (bool(line) or full), (op, arg)
        for task in tasks.values():
            task.cancel()

    asyncio.run(main())


async def test_a_wait_cancelled_as_its_slot_is_granted_gives_the_slot_on() -> None:
    slots = Slots(1)
    await slots.take("a")
    b = asyncio.ensure_future(slots.take("b"))
    c = asyncio.ensure_future(slots.take("c"))
    await asyncio.sleep(0)
    slots.give_back("a")  # granted to b in this step ...
    b.cancel()  # ... and b's task is cancelled before it runs again
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert b.cancelled() and c.done()
    assert slots.holders == ["c"] and slots.waiting == []


async def test_the_detail_names_who_is_starting() -> None:
    slots = Slots(2)
    await slots.take("worker@0")
    await slots.take("worker@1")
    assert slots.would_wait()
    assert slots.describe() == "2 of max_starting 2 starting: worker@0, worker@1"


# ------------------------------------------------------------------ the spec field


def _write(tmp_path: Path, text: str, name: str = "stack.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _load(path: Path, **var: object) -> spec.Stack:
    ports = itertools.count(40000)
    return spec.load(path, state_dir=path.parent / "state",
                     allocate_port=lambda: next(ports), var_overrides=var)  # fmt: skip


UNITS = """
    [units.a]
    command = ["a"]
"""


def test_max_starting_is_read_and_absent_means_no_limit(tmp_path: Path) -> None:
    assert _load(_write(tmp_path, UNITS)).max_starting is None
    assert _load(_write(tmp_path, "[stack]\nmax_starting = 3\n" + UNITS)).max_starting == 3


@pytest.mark.parametrize("bad", ["0", "-1", "257", "1.5", '"2"', "true", "[2]"])
def test_a_bad_max_starting_is_refused_naming_the_file_and_field(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[stack]\nmax_starting = {bad}\n" + UNITS)
    with pytest.raises(SpecError) as info:
        _load(path)
    assert info.value.field == "stack.max_starting" and info.value.file == str(path)
    assert "a whole number from 1 to 256" in str(info.value)


def test_only_the_stack_file_itself_may_set_max_starting(tmp_path: Path) -> None:
    part = _write(tmp_path, "[stack]\nmax_starting = 2\n" + UNITS, "part.toml")
    path = _write(tmp_path, '[stack]\ninclude = ["part.toml"]\n')
    with pytest.raises(SpecError) as info:
        _load(path)
    assert info.value.field == "stack.max_starting" and info.value.file == str(part)
    assert "only the stack file itself" in str(info.value)


def test_a_changed_max_starting_is_a_change_apply_shows(tmp_path: Path) -> None:
    running = _load(_write(tmp_path, UNITS))
    counter = itertools.count(50000)
    new = change.reread(_write(tmp_path, "[stack]\nmax_starting = 4\n" + UNITS), running, {},
                        allocate_port=lambda: next(counter))  # fmt: skip
    found = diff(running, new)
    assert not found.empty and not found.changed and found.restarted() == []
    assert found.tables == {"stack": {"max_starting": (None, 4)}}
    assert lines(found, {}) == ["~ [stack] max_starting: (unset) -> 4"]
    assert StackDiff.from_json(found.as_json()) == found
    assert diff(new, new).empty


# ------------------------------------------------------------------ status


def test_status_says_who_starts_and_who_waits_while_any_waits() -> None:
    from dynamod.control import render

    row = {
        "name": "svc@3", "unit": "svc", "index": 3, "state": "inactive", "since_s": 1.0,
        "pid": None, "uptime_s": None, "restarts": 0, "starts": 0, "last_exit": None,
        "detail": "waiting for a start slot (2 of max_starting 2 starting: svc@0, svc@1)",
        "ports": {}, "depends_on": {}, "cause": None,
    }  # fmt: skip
    stack = {"stack": "s", "phase": "starting", "daemon_pid": 1, "state_dir": "/x",
             "units": [row]}  # fmt: skip
    slots = {"max_starting": 2, "starting": ["svc@0", "svc@1"], "waiting": ["svc@3"]}
    table = render.status_table({**stack, "start_slots": slots})
    assert "start slots: 2 of max_starting 2 in use (svc@0, svc@1); waiting: svc@3" in table
    for quiet in ({**slots, "waiting": []}, None):  # nobody waits, or no limit: no line
        assert "start slots" not in render.status_table({**stack, "start_slots": quiet})
