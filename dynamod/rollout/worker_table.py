"""The Dynamo parts of the stack format: `[units.NAME.dynamo]` marks a unit as a Dynamo
worker (dynamod revokes its etcd registration the moment it dies, and reaches its engine
routes at `system_url`), and the `dynamo_frontend` probe kind. Registered with the core's
spec tables by `rollout.tables.register()`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynamod.core import limits
from dynamod.core.spec import HttpUrl, HttpUrls, ProbeBase, SpecModel, UnitSpec

KEY = "dynamo"


class DynamoWorkerSpec(SpecModel):
    """Marks a unit as a Dynamo worker: on death its etcd registration is revoked at once."""

    etcd: HttpUrls
    namespace: str
    system_url: HttpUrl


class DynamoFrontendProbe(ProbeBase):
    """Ready = enough `generate` instances registered and the model listed in /v1/models."""

    kind: Literal["dynamo_frontend"]
    url: HttpUrl
    namespace: str
    model: str
    min_instances: int = Field(1, ge=0, le=limits.MAX_INSTANCES)


def worker_of(spec: UnitSpec) -> DynamoWorkerSpec | None:
    """The unit's `dynamo` table: None for a unit that is no Dynamo worker."""
    table = spec.tables.get(KEY)
    return table if isinstance(table, DynamoWorkerSpec) else None
