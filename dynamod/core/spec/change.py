"""The stack a running one would become: its file read again (`apply`), or its own
definition with one unit's replicas changed (`scale`), resolved with every port the running
stack allocated kept, so only what really changes shows in the diff.

`--var` values the stack was started with are kept; a `--var` given now goes on top (a kept
one the new file no longer knows is dropped, and the diff shows it gone)."""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dynamod.core.errors import SpecError, SpecErrors, UnknownUnit, shown
from dynamod.core.spec.files import RawStack, load_stack
from dynamod.core.spec.resolve import resolve_stack
from dynamod.core.spec.stack import PortAllocator, Stack
from dynamod.core.spec.vars import check_overrides, variables

_ONE_VAR = re.compile(r"^\{vars\.([A-Za-z0-9_-]+)\}$")


def pinned_ports(stack: Stack) -> dict[str, dict[str, int]]:
    """Every instance's ports, to keep them when the stack is resolved again."""
    return {name: dict(spec.ports) for name, spec in stack.units.items()}


def reread(
    path: Path,
    running: Stack,
    given: Mapping[str, Any],
    *,
    allocate_port: PortAllocator,
) -> Stack:
    """`path` resolved as the next version of `running`; SpecErrors if it is not valid."""
    try:
        raw = load_stack(path, given)
        check_overrides(raw, given)
    except SpecError as exc:
        raise SpecErrors([exc]) from None
    if running.source is not None:
        known = variables(raw)
        kept = {k: v for k, v in running.source.raw.overrides().items() if k in known}
        raw.vars = {**raw.defaults, **kept, **given}
    return _resolve(raw, running, allocate_port)


def scaled(running: Stack, unit: str, count: int, *, allocate_port: PortAllocator) -> Stack:
    """`running` with `count` replicas of `unit`: the variable its `replicas` names, if it is
    exactly one (`replicas = "{vars.workers}"`), else its `replicas` itself."""
    if running.source is None:
        raise SpecErrors([SpecError("the running stack keeps no definition to scale")])
    raw = copy.deepcopy(running.source.raw)
    table = raw.units.get(unit)
    if table is None:
        known = sorted(raw.units)
        close = difflib.get_close_matches(unit, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"units: {', '.join(known)}"
        raise UnknownUnit(f"no unit {shown(unit)!r} in stack {running.name}; {hint}")
    replicas = table.table.get("replicas")
    if replicas is None:
        raise SpecErrors([SpecError(
            "is not a replicated unit (no `replicas`); change it with `dynamod apply`",
            file=table.source, unit=unit, field="replicas")])  # fmt: skip
    var = _ONE_VAR.match(replicas) if isinstance(replicas, str) else None
    if var is not None:
        raw.vars[var.group(1)] = count
    else:
        table.table["replicas"] = count
    return _resolve(raw, running, allocate_port)


def _resolve(raw: RawStack, running: Stack, allocate_port: PortAllocator) -> Stack:
    source = running.source
    if source is None:
        raise SpecErrors([SpecError("the running stack keeps no definition to compare with")])
    new = resolve_stack(
        raw,
        state_dir=source.state_dir,
        allocate_port=allocate_port,
        python=source.python,
        pinned=pinned_ports(running),
        node=source.node,
    )
    if new.name != running.name:
        problem = (f"is stack {new.name!r}, but the running stack is {running.name!r}; "
                   "another stack needs its own --state-dir")  # fmt: skip
        raise SpecErrors([SpecError(problem, file=raw.path, field="stack.name")])
    return new
