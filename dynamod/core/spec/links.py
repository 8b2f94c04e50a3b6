"""Dependencies between units: read from a raw unit's `depends_on`, linked to the
instances they name (a replicated unit's dependents wait for every replica), and checked
for conditions that can never be met."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dynamod.core import limits
from dynamod.core.errors import SpecError
from dynamod.core.spec.files import RawUnit
from dynamod.core.spec.models import Condition, UnitSpec
from dynamod.core.spec.render import short_repr


def dependencies(raw: RawUnit) -> dict[str, Condition]:
    """`depends_on` as written: a list of names (each `ready`) or a table name = condition."""
    value = raw.table.get("depends_on", {})
    if isinstance(value, list):
        value = {str(name): Condition.READY.value for name in value}
    if not isinstance(value, dict):
        raise SpecError(
            "must be a list of unit names or a table of name = condition",
            file=raw.source,
            unit=raw.name,
            field="depends_on",
        )
    if len(value) > limits.MAX_INSTANCES:
        raise SpecError(
            f"{len(value)} dependencies; a stack has at most {limits.MAX_INSTANCES} units",
            file=raw.source,
            unit=raw.name,
            field="depends_on",
        )
    deps: dict[str, Condition] = {}
    for name, cond in value.items():
        try:
            deps[name] = Condition(cond)
        except ValueError:
            raise SpecError(
                f"unknown condition {short_repr(cond)} (expected started, ready or completed)",
                file=raw.source,
                unit=raw.name,
                field=f"depends_on.{name}",
            ) from None
    return deps


def link(
    instance: str,
    raw: RawUnit,
    deps: Mapping[str, Condition],
    instances: Collection[str],
    replicated: Mapping[str, list[str]],
    unit_names: list[str],
) -> tuple[dict[str, Condition], list[SpecError]]:
    """`deps` of one instance -> the instances they name, and what names nothing. A name
    of a replicated unit stands for all its replicas; `NAME@i` for one of them."""
    linked: dict[str, Condition] = {}
    errors: list[SpecError] = []
    for dep, cond in deps.items():
        for target in replicated.get(dep, [dep]):
            where = f"depends_on.{dep}"
            if target not in instances:
                message = f"depends on unknown unit {dep!r}" + known_hint(unit_names)
                errors.append(SpecError(message, file=raw.source, unit=instance, field=where))
            elif target == instance:
                message = "a unit cannot depend on itself"
                errors.append(SpecError(message, file=raw.source, unit=instance, field=where))
            else:
                linked[target] = cond
    return linked, errors


def check_completed(specs: Mapping[str, UnitSpec]) -> list[SpecError]:
    """Waiting for a unit to complete that restarts `always` would wait forever."""
    errors = []
    for spec in specs.values():
        for dep, cond in spec.depends_on.items():
            target = specs[dep]
            if cond is Condition.COMPLETED and target.restart.policy == "always":
                errors.append(
                    SpecError(
                        f"waits for {dep!r} to complete, but {dep!r} has restart policy "
                        "'always' and never completes",
                        file=spec.source,
                        unit=spec.name,
                        field=f"depends_on.{dep}",
                    )
                )
    return errors


def known_hint(names: list[str], shown: int = 20) -> str:
    listed = names[:shown] + ([f"... {len(names) - shown} more"] if len(names) > shown else [])
    return f" (units in this stack: {', '.join(listed)})" if names else ""
