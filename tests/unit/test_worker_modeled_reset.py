"""The CPU worker's `--modeled-reset-s` (bench.fleet --modeled-reset): the mocker's engine
reset kept off the CPU. Refused without the mocker and outside its range; a reset keeps the
engine, waits, tells the router its blocks are gone and counts a generation; a dead engine
is not reset. The real worker's behaviour behind the frontend is in
tests/integration/test_cpu_worker.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dynamod.workers.cpu.args import MODELED_RESET_MAX_S, parse_args
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.mocker import MockerEngine


def test_the_flag_is_the_mocker_s_alone(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="models the mocker's reset: add --engine mocker"):
        parse_args(["--modeled-reset-s", "0.1", "--model-path", str(tmp_path)])
    ours, _ = parse_args(
        ["--engine", "mocker", "--modeled-reset-s", "0.1", "--model-path", str(tmp_path)]
    )
    assert ours.modeled_reset_s == 0.1
    ours, _ = parse_args(["--engine", "mocker", "--model-path", str(tmp_path)])
    assert ours.modeled_reset_s is None


@pytest.mark.parametrize("seconds", ["-0.1", str(MODELED_RESET_MAX_S + 1), "nan", "inf"])
def test_a_reset_outside_its_range_is_refused(tmp_path: Path, seconds: str) -> None:
    argv = ["--engine", "mocker", "--modeled-reset-s", seconds, "--model-path", str(tmp_path)]
    with pytest.raises(WorkerError, match=r"--modeled-reset-s: seconds from 0 to"):
        parse_args(argv)


class Discovery:
    """The engine's client: which instances its private discovery lists."""

    def __init__(self, *ids: int) -> None:
        self.ids = list(ids)

    def instance_ids(self) -> list[int]:
        return self.ids


class Bridge:
    """Records what the engine told the router."""

    def __init__(self) -> None:
        self.cleared = 0

    async def clear(self) -> None:
        self.cleared += 1


def engine(seconds: float | None) -> MockerEngine:
    return MockerEngine("model", "tiny", {}, lambda _error: None, modeled_reset_s=seconds)


async def test_a_modeled_reset_keeps_the_engine_and_clears_the_router_s_view() -> None:
    mocker = engine(0.05)
    serving: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    mocker._serving, mocker._instance_id = serving, 7  # as `start` leaves them
    mocker._client = Discovery(7)
    bridge = Bridge()
    mocker.kv_events = bridge  # type: ignore[assignment]
    begun = time.monotonic()
    await mocker.restart()
    assert time.monotonic() - begun >= 0.05
    assert mocker.alive and mocker._serving is serving and mocker._instance_id == 7
    assert bridge.cleared == 1 and mocker.generation == 1
    assert mocker.stats() == {"engine": "mocker", "modeled_reset_s": 0.05}
    serving.cancel()


async def test_an_engine_whose_instance_expired_is_built_again_not_modeled() -> None:
    """A starved worker's engine instance expires from its discovery and is never listed
    again: a modeled reset would keep an engine nothing can reach (a fleet's push hung
    on every shard's canary), so the reset builds a new one."""
    mocker = engine(0.05)
    mocker._serving, mocker._instance_id = asyncio.get_running_loop().create_future(), 7
    mocker._client = Discovery()  # 7 is gone
    calls: list[str] = []

    async def stop() -> None:
        calls.append("stop")

    async def start(timeout: float = 60.0) -> None:
        calls.append("start")

    mocker.stop, mocker.start = stop, start  # type: ignore[method-assign]
    await mocker.restart()
    assert calls == ["stop", "start"]
    mocker._client = Discovery(7)
    await mocker.restart()
    assert calls == ["stop", "start"] and mocker.generation == 1  # modeled this time


async def test_a_dead_engine_is_not_reset_by_a_model() -> None:
    mocker = engine(0.0)
    with pytest.raises(WorkerError, match="not running"):
        await mocker.restart()
    assert mocker.generation == 0
    assert engine(None).stats() == {"engine": "mocker"}
