"""Before a unit spawns: an allocated port of its that another process has taken since it
was allocated (a foreign listener between the unit's death and its restart) is allocated
again, and the stack is re-rendered from its source with every other port kept, so the
unit and every unit whose templates reference that port get the new number. Fixed ports
(a number in the unit file) are never moved: the operator chose them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dynamod.core import ports
from dynamod.core.spec import PortAllocator, Stack, resolve_stack


@dataclass(frozen=True)
class Moved:
    """The re-rendered stack, the unit's ports that moved (name -> (old, new)), and the
    other units whose rendered spec changed with them."""

    stack: Stack
    ports: dict[str, tuple[int, int]]
    referencing: list[str]


def taken(
    stack: Stack, instance: str, in_use: Callable[[int], bool] = ports.in_use
) -> dict[str, int]:
    """The unit's ports that something listens on now (the unit itself is not running)."""
    return {name: port for name, port in stack.units[instance].ports.items() if in_use(port)}


def move(
    stack: Stack, instance: str, names: set[str], *, allocate_port: PortAllocator
) -> Moved | None:
    """Re-render `stack` with the unit's ports `names` allocated again and every other port
    kept. None if the stack cannot be re-rendered (no source kept) or none of those ports
    is an allocated one."""
    source = stack.source
    if source is None:
        return None
    pinned = {
        name: {p: n for p, n in spec.ports.items() if not (name == instance and p in names)}
        for name, spec in stack.units.items()
    }
    new = resolve_stack(source.raw, state_dir=source.state_dir, allocate_port=allocate_port,
                        python=source.python, pinned=pinned, node=source.node)
    old_ports, new_ports = stack.units[instance].ports, new.units[instance].ports
    moved = {p: (old_ports[p], new_ports[p]) for p in names if new_ports[p] != old_ports[p]}
    if not moved:
        return None
    referencing = [name for name, spec in new.units.items()
                   if name != instance and spec != stack.units[name]]
    return Moved(new, moved, referencing)
