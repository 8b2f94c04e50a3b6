"""The CPU worker's error, and the typed error Dynamo's frontend migrates on."""

from __future__ import annotations

from dynamod.core.errors import DynamodError


class WorkerError(DynamodError):
    """The worker cannot start or keep serving; the message is for the operator."""


def engine_shutdown(message: str) -> Exception:
    """Dynamo's typed error for a dead engine: the frontend migrates such requests."""
    from dynamo.llm.exceptions import EngineShutdown

    error: Exception = EngineShutdown(message)
    return error
