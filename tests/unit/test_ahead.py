"""rollout/ahead.py: the updates on a push's answer path, lifted to the daemon's own nice
and set back, against a host that records what it was asked (pure logic; the real
reweighing is test_enforce_reweigh.py's)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from dynamod.core.engine import Engine
from dynamod.core.errors import SpecErrors
from dynamod.rollout.ahead import ahead
from dynamod.rollout.policy_table import policy_of
from tests.unit.test_update_slots import STACK, _load, _write


class Host:
    def __init__(self, answer: bool = True, fail: list[BaseException | None] | None = None):
        self.calls: list[tuple[str, int, int | None]] = []
        self.answer = answer
        self.fail = list(fail or [])

    def reweigh(self, unit: str, pid: int, nice: int | None) -> bool:
        self.calls.append((unit, pid, nice))
        error = self.fail.pop(0) if self.fail else None
        if error is not None:
            raise error
        return self.answer


def engine(host: Host, pid: int | None = 4242) -> Engine:
    units = {"worker@0": SimpleNamespace(pid=pid)}
    return cast(Engine, SimpleNamespace(units=units, host=host))


def update(the: Engine, shard: str = "worker@0", raises: bool = False) -> list[str]:
    """The shard's update inside `ahead`: what ran ("updating"), and whether it was lifted."""
    seen: list[str] = []

    async def run() -> None:
        async with ahead(the, shard) as lifted:
            seen.extend(["updating", "lifted" if lifted else "as it is"])
            if raises:
                raise RuntimeError("the shard refused")

    if raises:
        with pytest.raises(RuntimeError):
            asyncio.run(run())
    else:
        asyncio.run(run())
    return seen


def test_the_update_runs_at_the_daemon_s_nice_and_the_shard_s_own_after() -> None:
    host = Host()
    assert update(engine(host)) == ["updating", "lifted"]
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert host.calls == [("worker@0", 4242, mine), ("worker@0", 4242, None)]


def test_a_failed_update_is_set_back_too() -> None:
    host = Host()
    update(engine(host), raises=True)
    assert [nice for *_, nice in host.calls][-1] is None and len(host.calls) == 2


def test_a_shard_without_a_nice_of_its_own_or_a_process_is_left_as_it_is() -> None:
    host = Host(answer=False)
    assert update(engine(host)) == ["updating", "as it is"]
    assert len(host.calls) == 1  # asked once; nothing lifted, nothing to set back
    host = Host()
    update(engine(host, pid=None))
    update(engine(host), shard="worker@9")  # not a unit of this daemon
    assert host.calls == []


def test_a_daemon_that_may_not_lift_says_why_and_the_update_goes_on() -> None:
    host = Host(fail=[PermissionError(1, "Operation not permitted")])
    with capture_logs() as logs:
        assert update(engine(host)) == ["updating", "as it is"]
    assert len(host.calls) == 1
    (warned,) = [e for e in logs if e["event"] == "policy.shard_not_lifted"]
    assert warned["unit"] == "worker@0" and "Operation not permitted" in warned["error"]


def test_a_shard_gone_before_it_is_set_back_is_no_error() -> None:
    host = Host(fail=[None, ProcessLookupError(3, "No such process")])
    with capture_logs() as logs:
        update(engine(host))
    assert len(host.calls) == 2
    assert not [e for e in logs if e["log_level"] == "warning"], logs


def test_the_logs_say_when_a_shard_was_lifted_and_set_back() -> None:
    with capture_logs() as logs:
        update(engine(Host()))
    kinds: list[Any] = [e["event"] for e in logs]
    assert kinds == ["policy.shard_lifted", "policy.shard_lowered"]


def test_lift_answering_is_on_unless_the_stack_says_false(tmp_path: Path) -> None:
    def lift(text: str) -> bool:
        policy = policy_of(_load(_write(tmp_path, STACK + text)))
        assert policy is not None
        return policy.lift_answering

    assert lift("") and lift("    lift_answering = true\n")
    assert not lift("    lift_answering = false\n")


@pytest.mark.parametrize("bad", ['"yes"', "1", "[true]"])
def test_a_bad_lift_answering_is_refused_naming_the_file_and_field(
    tmp_path: Path, bad: str
) -> None:
    path = _write(tmp_path, STACK + f"    lift_answering = {bad}\n")
    with pytest.raises(SpecErrors) as info:
        _load(path)
    [error] = info.value.errors
    assert error.field == "policy.lift_answering" and error.file == str(path)
