"""The integration's errors: each says what was expected, what was seen, and where to look."""

from __future__ import annotations

from dynamod.core.errors import DynamodError


class VerlIntegrationError(DynamodError):
    """Base of everything the verl integration raises."""


class UnsupportedVerlError(VerlIntegrationError, ImportError):
    """The installed verl is not a version this module was written and tested against."""


class RolloutConfigError(VerlIntegrationError, ValueError):
    """A rollout setting is unknown, owned by dynamod, or conflicts with the stack."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class StackNotReadyError(VerlIntegrationError, RuntimeError):
    """The dynamod stack is not up, or cannot serve the rollout layout verl asked for."""


class GenerationError(VerlIntegrationError, RuntimeError):
    """The frontend did not return a usable completion."""


class EngineCallError(VerlIntegrationError, RuntimeError):
    """A shard's engine route answered an error (or nothing)."""
