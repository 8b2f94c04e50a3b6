"""The stack's `[policy]` table: where the policy ledger lives and which units are rollout
shards; `spares = K` adds K instances to the shard unit's replicas (they run beside the
serving shards, which keep their own count). Registered with the core's spec tables by
`rollout.tables.register()`; `policy_of` and `shards` read it back from a resolved stack."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from dynamod.core import limits
from dynamod.core.errors import SpecError
from dynamod.core.spec import HttpUrls, RawStack, SpecModel, Stack, UnitSpec
from dynamod.core.spec.models import count, seconds
from dynamod.core.spec.tables import Render
from dynamod.rollout.worker_table import worker_of

KEY = "policy"


def _whole_number(value: Any) -> Any:
    """TOML's true would pass as 1."""
    if isinstance(value, bool):
        raise ValueError(f"must be a whole number, got {str(value).lower()}")
    return value


class PolicySpec(SpecModel):
    """The stack's policy ledger and which units are rollout shards (`[policy]` table)."""

    store: Literal["etcd", "file"] = "etcd"
    etcd: HttpUrls | None = Field(
        None, description="etcd endpoint(s), comma-separated, when store = 'etcd'"
    )
    shards: list[str] = Field(min_length=1, description="unit names that are rollout shards")
    keep: int = count(
        3, minimum=1, maximum=1000, description="policy versions kept in the ledger's history"
    )
    min_ready_shards: int = Field(1, ge=0, le=limits.MAX_INSTANCES)
    spares: int = Field(
        0,
        ge=0,
        le=limits.MAX_INSTANCES,
        description="extra shard instances kept ready at the current version, unrouted",
    )
    initial_version: int = Field(
        0, ge=0, le=2**63 - 1, description="version of the weights shards boot with"
    )
    max_updating: Annotated[int | None, BeforeValidator(_whole_number)] = Field(
        None,
        ge=1,
        le=limits.MAX_INSTANCES,
        description="this node's shards applying a policy update (a push's, a replay's) at "
        "once; the rest wait their turn, still serving (none: no limit)",
    )
    taint_prefix: str = "dynamod.policy/"
    replay_backoff_initial: float = seconds(0.5, positive=True)
    replay_backoff_max: float = seconds(10.0, positive=True)
    call_timeout: float = seconds(
        300.0, positive=True, description="seconds one engine admin call may take"
    )
    route_timeout: float = seconds(
        60.0,
        positive=True,
        description="seconds a shard may wait for the router to route its new version",
    )



def policy_of(stack: Stack) -> PolicySpec | None:
    """The stack's `[policy]` table: None for a stack without rollout shards."""
    table = stack.tables.get(KEY)
    return table if isinstance(table, PolicySpec) else None


def shards(stack: Stack) -> list[str]:
    """Instance names of this node's rollout shards, in start order."""
    policy = policy_of(stack)
    if policy is None:
        return []
    return [
        n
        for n in stack.order
        if stack.units[n].unit in policy.shards and stack.units[n].remote is None
    ]


def spare_replicas(table: Mapping[str, Any], raw: RawStack, render: Render) -> dict[str, int]:
    """`spares = K` adds K instances to the (one) shard unit's replicas."""
    if "spares" not in table:
        return {}
    value = render(table["spares"], "policy.spares")
    try:
        spares = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        spares = -1
    if not 0 <= spares <= limits.MAX_INSTANCES:
        raise SpecError(
            f"must be an integer between 0 and {limits.MAX_INSTANCES}, got {value!r}",
            file=raw.path,
            field="policy.spares",
        )
    names = table.get("shards")
    if spares == 0 or not isinstance(names, list):
        return {}
    if len(names) != 1:
        raise SpecError(
            f"spares = {spares} needs exactly one shard unit, got {names!r}",
            file=raw.path,
            field="policy.spares",
        )
    unit = raw.units.get(str(names[0]))
    if unit is not None and "replicas" not in unit.table:
        raise SpecError(
            f"spares = {spares} needs shard unit {names[0]!r} to have replicas",
            file=raw.path,
            field="policy.spares",
        )
    return {str(names[0]): spares}


def check(policy: PolicySpec, specs: Mapping[str, UnitSpec], path: Path) -> list[SpecError]:
    """Every shard unit is in the stack and is a Dynamo worker; an etcd ledger has etcd."""
    errors = []
    bases = {s.unit for s in specs.values()}
    for name in policy.shards:
        if name not in bases:
            errors.append(
                SpecError(
                    f"shard unit {name!r} is not in the stack", file=path, field="policy.shards"
                )
            )
        elif not any(worker_of(s) for s in specs.values() if s.unit == name):
            errors.append(
                SpecError(
                    f"shard unit {name!r} needs a [units.{name}.dynamo] table (system_url) so "
                    "dynamod can reach its engine routes",
                    file=path,
                    field="policy.shards",
                )
            )
    if policy.store == "etcd" and not policy.etcd:
        errors.append(
            SpecError(
                "store = 'etcd' needs etcd = \"http://host:port\"",
                file=path,
                field="policy.etcd",
            )
        )
    return errors
