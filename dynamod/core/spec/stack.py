"""A resolved stack: validated unit instances in start order, and what they were rendered
from so the daemon can render them again (with moved ports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamod.core.placement import ClusterSpec
from dynamod.core.spec.files import RawStack
from dynamod.core.spec.models import PolicySpec, UnitSpec

PortAllocator = Callable[[], int]


@dataclass(frozen=True)
class StackSource:
    """What `resolve_stack` rendered a stack from: the same inputs render it again."""

    raw: RawStack
    state_dir: Path
    python: str
    node: str | None = None


@dataclass(frozen=True)
class Stack:
    """A validated stack: instances in start order, ready for the engine."""

    name: str
    path: Path
    units: dict[str, UnitSpec]
    order: list[str]
    policy: PolicySpec | None = None
    # what it was resolved from, so allocated ports can be moved and the stack re-rendered
    source: StackSource | None = field(default=None, compare=False, repr=False)
    cluster: ClusterSpec | None = None

    def shards(self) -> list[str]:
        """Instance names of this node's rollout shards, in start order."""
        if self.policy is None:
            return []
        return [
            n
            for n in self.order
            if self.units[n].unit in self.policy.shards and self.units[n].remote is None
        ]


