"""Which extensions a daemon runs with. Extensions add behaviour around units without
touching the engine: Dynamo lease revocation on worker death, sd_notify, metrics. (Shard
admission is added by the daemon itself when the stack has a [policy] table.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamod.metrics import MetricsServer
from dynamod.registrations import DynamoRegistrations
from dynamod.sdnotify import SystemdNotifier

if TYPE_CHECKING:
    from dynamod.daemon import Extension


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
