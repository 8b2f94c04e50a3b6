"""Which units an operator's `stop UNIT` / `start UNIT` names, and what each does to them.
Pure logic: the engine acts on the plan.

    UNIT is a unit (`frontend`), a replica (`worker@1`) or every replica by its base
    name (`worker`); anything else is an UnknownUnit naming the closest names.
    stop:  a unit already held stopped by the operator is left as it is ("already stopped")
    start: only a unit the operator stopped is started; any other is left, saying its state
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamod.core.errors import UnknownUnit, shown
from dynamod.core.state import UnitState

STOPPED_BY = "`dynamod stop`"


def select(name: str, bases: Mapping[str, str]) -> list[str]:
    """The units `name` means; `bases` maps each unit (replica) name to its base name."""
    if name in bases:
        return [name]
    replicas = [unit for unit, base in bases.items() if base == name]
    if replicas:
        return replicas
    known = sorted({*bases, *bases.values()})
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"units: {', '.join(known)}"
    raise UnknownUnit(f"no unit {shown(name)!r} in this stack; {hint}")


@dataclass(frozen=True)
class UnitView:
    name: str
    state: UnitState
    held: bool  # held stopped by the operator


@dataclass
class Plan:
    act: list[str] = field(default_factory=list)
    already: dict[str, str] = field(default_factory=dict)  # unit -> why nothing is done


def plan(action: str, units: list[UnitView]) -> Plan:
    """What `stop` or `start` does to each of `units`."""
    result = Plan()
    for unit in units:
        if action == "stop":
            if unit.held:
                result.already[unit.name] = f"already stopped by {STOPPED_BY}"
            else:
                result.act.append(unit.name)
        elif unit.held:
            result.act.append(unit.name)
        elif unit.state.running:
            result.already[unit.name] = f"already running ({unit.state})"
        else:
            result.already[unit.name] = (
                f"is {unit.state}, not stopped by {STOPPED_BY}; `dynamod restart` starts it"
            )
    return result
