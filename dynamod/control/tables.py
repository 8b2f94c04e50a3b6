"""Every table the layers above the core add to the stack format, registered at once: the
rollout layer's (`dynamo` unit table, `[policy]`, the `dynamo_frontend` probe) and the
status page's `[web]`. Whatever reads a stack file calls `register()` first; idempotent."""

from __future__ import annotations

from dynamod.ops import web_table
from dynamod.rollout import tables as rollout_tables


def register() -> None:
    rollout_tables.register()
    web_table.register()
