"""The CPU worker's admission mode: the transition table alone, then the worker's routes
driving it with a stand-in engine whose output a test releases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.workers.cpu.admission import CpuWorker
from dynamod.workers.cpu.admission_mode import TRANSITIONS, Event, Mode, after
from dynamod.workers.weights import load_checkpoint
from tests.unit.test_worker_weights import IdleEngine, save, tensors


def test_every_mode_answers_every_event_and_closing_is_final() -> None:
    for mode in Mode:
        for event in Event:
            assert after(mode, event) in Mode
            if mode is not Mode.CLOSED and event is not Event.CLOSE:
                assert event in TRANSITIONS[mode], (mode, event)
        assert after(mode, Event.CLOSE) is Mode.CLOSED
    assert {after(Mode.CLOSED, event) for event in Event} == {Mode.CLOSED}


@pytest.mark.parametrize(
    ("events", "mode"),
    [
        ([Event.PAUSE], Mode.PAUSED),
        ([Event.HOLD], Mode.HOLDING),
        ([Event.HOLD, Event.PAUSE], Mode.PAUSED),  # a later "wait" pause releases output
        ([Event.HOLD, Event.RESUME], Mode.OPEN),
        ([Event.HOLD, Event.SLEEP], Mode.PAUSED_ASLEEP),
        ([Event.PAUSE, Event.SLEEP, Event.WAKE], Mode.PAUSED),  # woken, still paused
        ([Event.PAUSE, Event.SLEEP, Event.RESUME], Mode.ASLEEP),  # resumed, still asleep
        ([Event.SLEEP, Event.PAUSE, Event.RESUME, Event.WAKE], Mode.OPEN),
        ([Event.SLEEP, Event.WAKE], Mode.OPEN),
        ([Event.HOLD, Event.WAKE], Mode.HOLDING),  # waking an awake worker changes nothing
    ],
)
def test_transitions(events: list[Event], mode: Mode) -> None:
    current = Mode.OPEN
    for event in events:
        current = after(current, event)
    assert current is mode


def test_only_open_admits_and_the_reports_follow_the_mode() -> None:
    assert [m for m in Mode if m.admits] == [Mode.OPEN]
    assert {m for m in Mode if m.paused} == {Mode.PAUSED, Mode.HOLDING, Mode.PAUSED_ASLEEP}
    assert {m for m in Mode if m.asleep} == {Mode.ASLEEP, Mode.PAUSED_ASLEEP}


class GatedEngine(IdleEngine):
    """Produces its chunk once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        await self.gate.wait()
        yield {"token_ids": [1], "index": 0, "finish_reason": "length"}


def worker(tmp_path: Path, engine: IdleEngine) -> CpuWorker:
    weights = load_checkpoint(save(tmp_path / "w", tensors(0)))
    return CpuWorker(engine, weights)  # type: ignore[arg-type]


async def collect(w: CpuWorker) -> list[Any]:
    return [chunk async for chunk in w.generate({"token_ids": [1]})]


async def state(w: CpuWorker) -> tuple[bool, bool]:
    reply = await w.liveness_probe({})
    return reply["paused"], reply["sleeping"]


async def test_a_keep_pause_holds_output_through_a_flush_until_resume(tmp_path: Path) -> None:
    engine = GatedEngine()
    w = worker(tmp_path, engine)
    pending = asyncio.create_task(collect(w))
    await asyncio.sleep(0.01)  # admitted, waiting in the engine
    assert (await w.pause_generation({"mode": "keep"}))["status"] == "ok"
    engine.gate.set()  # the engine produces; the worker holds it back
    assert (await w.flush_cache({}))["status"] == "ok"  # the engine is replaced meanwhile
    await asyncio.sleep(0.02)
    assert not pending.done(), "held output left during the pause"
    assert await state(w) == (True, False)
    await w.resume_generation({})
    chunks = await asyncio.wait_for(pending, 2)
    assert chunks[-1]["finish_reason"] == "length"
    assert engine.generation == 2


async def test_woken_while_paused_it_stays_paused(tmp_path: Path) -> None:
    w = worker(tmp_path, IdleEngine())
    await w.pause_generation({"mode": "wait"})
    assert (await w.sleep({"level": 1}))["message"] == "Engine slept (level=1)"
    assert await state(w) == (True, True)
    await w.resume_generation({})
    assert await state(w) == (False, True)
    save(tmp_path / "next", tensors(1))
    refused = await w.update_weights_from_disk({"model_path": str(tmp_path / "next")})
    assert refused["message"].startswith("Worker must be paused")
    await w.pause_generation({})
    assert (await w.update_weights_from_disk({"model_path": str(tmp_path / "next")}))[
        "message"
    ].startswith("Engine is sleeping")
    await w.wake_up({})
    assert await state(w) == (True, False)
    pending = asyncio.create_task(collect(w))
    await asyncio.sleep(0.02)
    assert not pending.done(), "admitted while paused"
    await w.resume_generation({})
    assert (await asyncio.wait_for(pending, 2))[-1]["finish_reason"] == "length"


async def test_closing_ends_the_wait_of_a_request_at_admission(tmp_path: Path) -> None:
    w = worker(tmp_path, IdleEngine())
    await w.pause_generation({})
    pending = asyncio.create_task(collect(w))
    await asyncio.sleep(0.01)
    await w.close()
    from dynamo.llm.exceptions import EngineShutdown

    with pytest.raises(EngineShutdown, match="worker is shutting down"):
        await asyncio.wait_for(pending, 2)
    assert await state(w) == (False, False)


async def test_a_flush_keeps_an_engine_that_served_nothing_since_it_was_built(
    tmp_path: Path,
) -> None:
    """A push's replay flushes right after the update built a new engine (on the mocker a
    new Dynamo runtime each): an engine no request entered holds no cached block, so the
    flush keeps it; one that served is replaced, and a flush right after keeps that."""
    engine = IdleEngine()
    w = worker(tmp_path, engine)
    assert (await w.flush_cache({}))["status"] == "ok"
    assert engine.generation == 1  # nothing served since the start
    await collect(w)
    assert (await w.flush_cache({}))["status"] == "ok"
    assert engine.generation == 2
    assert (await w.flush_cache({}))["status"] == "ok"
    assert engine.generation == 2
    await collect(w)
    await w.pause_generation({})
    save(tmp_path / "next", tensors(1))
    assert (await w.update_weights_from_disk({"model_path": str(tmp_path / "next")}))[
        "status"
    ] == "ok"
    assert engine.generation == 3  # the update replaces it whatever it served: new weights
    assert (await w.flush_cache({}))["status"] == "ok"
    assert engine.generation == 3  # the replay's flush: nothing to clear
