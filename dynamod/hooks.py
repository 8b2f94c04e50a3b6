"""Which hooks a daemon runs with. Hooks add behaviour around units without touching the
engine: Dynamo lease revocation on worker death, shard admission, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamod.daemon import Daemon
    from dynamod.supervisor import UnitHooks


def default_hooks() -> list[Callable[[Daemon], UnitHooks]]:
    return []
