"""Which extensions a daemon runs with: the composition of the layers above the core.

Extensions add behaviour around units without touching the engine: Dynamo lease
revocation on worker death, shard admission and policy updates when the stack has a
[policy] table, the node's cluster membership when it has a [cluster] table, sd_notify
under systemd, metrics and the status page when asked for.
"""

from __future__ import annotations

from pathlib import Path

from dynamod.chaos import report
from dynamod.cluster.exposure import ExposureWatch
from dynamod.cluster.membership import Membership
from dynamod.cluster.secrets import load_etcd_auth
from dynamod.cluster.secrets_env import SecretsEnv
from dynamod.control import tables
from dynamod.core.extensions import Extension
from dynamod.core.spec import Stack
from dynamod.ops.metrics import MetricsServer
from dynamod.ops.sdnotify import SystemdNotifier
from dynamod.ops.statuspage import StatusPage, WebSettings
from dynamod.rollout import frontend_probe
from dynamod.rollout.identity import StackIdentity
from dynamod.rollout.policy import PolicyManager
from dynamod.rollout.policy_table import policy_of
from dynamod.rollout.registrations import DynamoRegistrations


def _secrets_dir(stack: Stack) -> str | None:
    """The [cluster] table's `secrets` (CLUSTER's spec model; absent before it lands)."""
    cluster = getattr(stack, "cluster", None)
    return getattr(cluster, "secrets", None) or None


def default_extensions(
    stack: Stack, *, metrics_addr: str | None = None, web: WebSettings | None = None
) -> list[Extension]:
    """Dynamo registrations and the exposure watch always (the former a no-op without
    Dynamo units); a cluster stack's secrets for its Dynamo units; the policy manager for a
    stack with rollout shards; sd_notify when run under systemd; metrics and the status
    page when asked for."""
    tables.register()
    frontend_probe.register()
    secrets_dir = _secrets_dir(stack)
    # dynamod's own etcd clients (lease revocation, the ledger) log in as the stack's user
    etcd_auth = (
        load_etcd_auth(secrets_dir, stack.cluster.node if stack.cluster else None)
        if secrets_dir
        else None
    )
    registrations = DynamoRegistrations(etcd_auth)
    # the identity first: a refused one stops the daemon before the others start anything
    extensions: list[Extension] = [StackIdentity(registrations, etcd_auth), registrations]
    extensions.append(ExposureWatch())
    if secrets_dir:
        extensions.append(SecretsEnv(Path(secrets_dir)))
    spec = policy_of(stack)
    policy = (
        PolicyManager(spec, registrations, etcd_auth=etcd_auth) if spec is not None else None
    )
    if policy is not None:
        extensions.append(policy)
    if stack.cluster is not None:
        extensions.append(Membership(stack.cluster, registrations, policy))
    notifier = SystemdNotifier.from_environment()
    if notifier is not None:
        extensions.append(notifier)
    if metrics_addr:
        extensions.append(MetricsServer(metrics_addr))
    if web is not None:
        extensions.append(StatusPage(web, report.runs))
    return extensions
