"""The `[policy]` table: extra shard replicas for spares, and the resolved policy spec
checked against the stack's shard units."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from dynamod.core import limits
from dynamod.core.errors import SpecError
from dynamod.core.spec.files import RawStack, RawUnit
from dynamod.core.spec.models import PolicySpec, UnitSpec
from dynamod.core.spec.render import Renderer, pydantic_errors


def spare_replicas(
    raw: RawStack, context: Mapping[str, Any], renderer: Renderer
) -> dict[str, int]:
    """`[policy] spares = K` adds K instances to the shard unit's replicas: the spares
    run beside the serving shards, which keep their own count."""
    if raw.policy is None or "spares" not in raw.policy:
        return {}
    holder = RawUnit(name="[policy]", source=raw.path, table=raw.policy)
    value = renderer.field(raw.policy["spares"], context, holder, "policy.spares")
    try:
        count = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        count = -1
    if not 0 <= count <= limits.MAX_INSTANCES:
        raise SpecError(
            f"must be an integer between 0 and {limits.MAX_INSTANCES}, got {value!r}",
            file=raw.path,
            field="policy.spares",
        )
    shards = raw.policy.get("shards")
    if count == 0 or not isinstance(shards, list):
        return {}
    if len(shards) != 1:
        raise SpecError(
            f"spares = {count} needs exactly one shard unit, got {shards!r}",
            file=raw.path,
            field="policy.spares",
        )
    unit = raw.units.get(str(shards[0]))
    if unit is not None and "replicas" not in unit.table:
        raise SpecError(
            f"spares = {count} needs shard unit {shards[0]!r} to have replicas",
            file=raw.path,
            field="policy.spares",
        )
    return {str(shards[0]): count}


def resolve_policy(
    raw: RawStack,
    context: Mapping[str, Any],
    specs: Mapping[str, UnitSpec],
    errors: list[SpecError],
    renderer: Renderer,
) -> PolicySpec | None:
    if raw.policy is None:
        return None
    holder = RawUnit(name="[policy]", source=raw.path, table=raw.policy)
    try:
        rendered = renderer.field(raw.policy, context, holder, "policy")
        policy = PolicySpec.model_validate(rendered)
    except SpecError as exc:
        errors.append(exc)
        return None
    except ValidationError as exc:
        errors.extend(
            SpecError(e.message, file=raw.path, field=f"policy.{e.field}" if e.field else "policy")
            for e in pydantic_errors(exc, holder, "[policy]")
        )
        return None
    bases = {s.unit for s in specs.values()}
    for name in policy.shards:
        if name not in bases:
            errors.append(
                SpecError(
                    f"shard unit {name!r} is not in the stack", file=raw.path, field="policy.shards"
                )
            )
        elif not any(s.dynamo for s in specs.values() if s.unit == name):
            errors.append(
                SpecError(
                    f"shard unit {name!r} needs a [units.{name}.dynamo] table (system_url) so "
                    "dynamod can reach its engine routes",
                    file=raw.path,
                    field="policy.shards",
                )
            )
    if policy.store == "etcd" and not policy.etcd:
        errors.append(
            SpecError(
                "store = 'etcd' needs etcd = \"http://host:port\"",
                file=raw.path,
                field="policy.etcd",
            )
        )
    return policy

