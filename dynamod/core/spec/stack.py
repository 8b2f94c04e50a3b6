"""A resolved stack: validated unit instances in start order, and what they were rendered
from so the daemon can render them again (with moved ports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamod.core.placement import ClusterSpec
from dynamod.core.spec.files import RawStack, default_id
from dynamod.core.spec.models import SpecModel, UnitSpec

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
    # what it was resolved from, so allocated ports can be moved and the stack re-rendered
    source: StackSource | None = field(default=None, compare=False, repr=False)
    cluster: ClusterSpec | None = None
    # the stack tables a layer above the core registered (e.g. [policy]), by key
    tables: dict[str, SpecModel] = field(default_factory=dict)
    id: str = ""  # `vars.stack_id` as rendered; empty: a stack built without the resolver
    # `[stack] max_starting`: units of this node starting at once (None: no limit)
    max_starting: int | None = None

    @property
    def identity(self) -> str:
        """The stack's identity in a shared etcd: its keys live under `dynamod/<identity>/`,
        and two daemons of one identity on one etcd are refused (rollout/identity.py)."""
        return self.id or default_id(self.name)
