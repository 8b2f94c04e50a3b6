"""Plug the rollout layer's parts of the stack format into the core's spec tables: the
`dynamo` unit table, the `[policy]` stack table and the `dynamo_frontend` probe kind.
Whatever reads a stack file that may have them calls `register()` first (the CLI's stack
loading, the daemon's composition, the systemd readiness helper); it is idempotent."""

from __future__ import annotations

from dynamod.core.spec import (
    StackTable,
    UnitTable,
    register_probe,
    register_stack_table,
    register_unit_table,
)
from dynamod.rollout import policy_table, worker_table


def register() -> None:
    register_unit_table(UnitTable(worker_table.KEY, worker_table.DynamoWorkerSpec))
    register_probe("dynamo_frontend", worker_table.DynamoFrontendProbe)
    register_stack_table(
        StackTable(
            policy_table.KEY,
            policy_table.PolicySpec,
            extra_replicas=policy_table.spare_replicas,
            check=policy_table.check,
        )
    )
