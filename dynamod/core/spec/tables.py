"""Tables that a layer above the core adds to the stack format, so the core reads and
checks them without knowing what they mean: a unit table (`[units.NAME.dynamo]`) is
validated by its model and kept in `UnitSpec.tables`; a stack table (`[policy]`, only in
the stack file itself) may add replicas to units before they are expanded, is rendered
and validated by its model, checked against the resolved units, and kept in
`Stack.tables`. The rollout layer registers its tables at start-up, as it registers its
probe kind (`models.register_probe`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dynamod.core.errors import SpecError
from dynamod.core.spec.files import RawStack, RawUnit, register_stack_key
from dynamod.core.spec.models import SpecModel, UnitSpec
from dynamod.core.spec.render import Renderer, pydantic_errors

# (value, field) -> the value rendered in the stack's context; errors name `field`
Render = Callable[[Any, str], Any]
ExtraReplicas = Callable[[Mapping[str, Any], RawStack, Render], dict[str, int]]
Check = Callable[[Any, Mapping[str, UnitSpec], Path], list[SpecError]]


@dataclass(frozen=True)
class UnitTable:
    """`[units.NAME.<key>]`, validated by `model`."""

    key: str
    model: type[SpecModel]


@dataclass(frozen=True)
class StackTable:
    """`[<key>]` in the stack file, validated by `model`. `extra_replicas` (from the raw
    table) adds instances to units; `check` sees the resolved table and units."""

    key: str
    model: type[SpecModel]
    extra_replicas: ExtraReplicas | None = None
    check: Check | None = None


_UNIT_TABLES: dict[str, UnitTable] = {}
_STACK_TABLES: dict[str, StackTable] = {}
_CORE_UNIT_KEYS = frozenset(UnitSpec.model_fields) | {"replicas", "ports", "depends_on", "nodes"}


def register_unit_table(table: UnitTable) -> None:
    """Idempotent; a key core or another table already uses is refused."""
    if table.key in _CORE_UNIT_KEYS or _UNIT_TABLES.get(table.key, table) != table:
        raise ValueError(f"unit table {table.key!r} is already taken")
    _UNIT_TABLES[table.key] = table


def register_stack_table(table: StackTable) -> None:
    """Idempotent; a key core or another table already uses is refused."""
    if _STACK_TABLES.get(table.key, table) != table:
        raise ValueError(f"stack table {table.key!r} is already taken")
    register_stack_key(table.key)
    _STACK_TABLES[table.key] = table


def unit_tables(
    rendered: dict[str, Any], raw: RawUnit, instance: str
) -> tuple[dict[str, SpecModel], list[SpecError]]:
    """Take the registered tables out of a unit's rendered fields and validate each."""
    found: dict[str, SpecModel] = {}
    errors: list[SpecError] = []
    for key, table in _UNIT_TABLES.items():
        if key not in rendered:
            continue
        try:
            found[key] = table.model.model_validate(rendered.pop(key))
        except ValidationError as exc:
            errors.extend(pydantic_errors(exc, raw, instance, prefix=key))
    return found, errors


def extra_replicas(
    raw: RawStack, context: Mapping[str, Any], renderer: Renderer
) -> dict[str, int]:
    """What the stack's registered tables add to their units' replicas."""
    extra: dict[str, int] = {}
    for key, table in _STACK_TABLES.items():
        if table.extra_replicas is None or key not in raw.tables:
            continue
        holder = RawUnit(name=f"[{key}]", source=raw.path, table=raw.tables[key])

        def render(value: Any, where: str, holder: RawUnit = holder) -> Any:
            return renderer.field(value, context, holder, where)

        for unit, count in table.extra_replicas(raw.tables[key], raw, render).items():
            extra[unit] = extra.get(unit, 0) + count
    return extra


def stack_tables(
    raw: RawStack,
    context: Mapping[str, Any],
    specs: Mapping[str, UnitSpec],
    renderer: Renderer,
    errors: list[SpecError],
) -> dict[str, SpecModel]:
    """The stack's registered tables, rendered, validated and checked."""
    found: dict[str, SpecModel] = {}
    for key, table in _STACK_TABLES.items():
        if key not in raw.tables:
            continue
        holder = RawUnit(name=f"[{key}]", source=raw.path, table=raw.tables[key])
        try:
            model = table.model.model_validate(renderer.field(holder.table, context, holder, key))
        except SpecError as exc:
            errors.append(exc)
            continue
        except ValidationError as exc:
            errors.extend(
                SpecError(e.message, file=raw.path, field=e.field)
                for e in pydantic_errors(exc, holder, holder.name, prefix=key)
            )
            continue
        if table.check is not None:
            errors.extend(table.check(model, specs, raw.path))
        found[key] = model
    return found
