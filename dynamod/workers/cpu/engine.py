"""What the admission layer needs of an engine: the numpy engine and the mocker both fit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from dynamod.workers.cpu.kv_events import KvEventBridge
from dynamod.workers.weights import WeightSet


class Engine(Protocol):
    """A generation engine the worker can restart in place (a flush, new weights)."""

    generation: int  # how many times it has been started; a flush adds one

    @property
    def alive(self) -> bool: ...

    def reachable(self) -> bool:
        """Whether requests can reach the running engine (the mocker's: its instance
        still listed in its private discovery)."""
        ...

    def bind_kv_events(self, bridge: KvEventBridge) -> None: ...

    def check_weights(self, weights: WeightSet) -> None:
        """WorkerError where the engine could not start with these weights (checked before
        the running engine is stopped for them)."""
        ...

    def use_weights(self, weights: WeightSet) -> None: ...

    def halt(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def start(self, timeout: float = 60.0) -> None: ...

    async def restart(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]: ...
