"""Which hooks a daemon runs with. Hooks add behaviour around units without touching the
engine: Dynamo lease revocation on worker death, shard admission, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dynamod.metrics import MetricsServer
from dynamod.registrations import DynamoRegistrations
from dynamod.sdnotify import SystemdNotifier

if TYPE_CHECKING:
    from dynamod.daemon import Daemon, Extension
    from dynamod.supervisor import UnitHooks


def default_hooks() -> list[Callable[[Daemon], UnitHooks]]:
    return []


def default_extensions(*, metrics_addr: str | None = None) -> list[Extension]:
    """Dynamo registrations always (a no-op without Dynamo units); sd_notify when run under
    systemd; Prometheus metrics when asked for."""
    extensions: list[Extension] = [DynamoRegistrations()]
    notifier = SystemdNotifier.from_environment()
    if notifier is not None:
        extensions.append(notifier)
    if metrics_addr:
        extensions.append(MetricsServer(metrics_addr))
    return extensions
