"""What verl loads: refuses an unsupported verl, installs the `cpu` platform, then
registers rollout `dynamod`.

Loaded by `import verl` through the `verl.plugins` entry point (installed with the
`verl` extra) or VERL_USE_EXTERNAL_MODULES=dynamod.integrations.verl.plugin. verl
swallows a plug-in's import error at debug level, so the refusal is also logged as an
error before it is raised.
"""

from __future__ import annotations

import logging

from dynamod.integrations.verl import ROLLOUT_NAME
from dynamod.integrations.verl.errors import UnsupportedVerlError
from dynamod.integrations.verl.version import check_verl_version, installed_verl_version

ADAPTER = "dynamod.integrations.verl.adapter.DynamodServerAdapter"

try:
    check_verl_version(installed_verl_version())
except UnsupportedVerlError as _exc:
    logging.getLogger("dynamod.integrations.verl").error("%s", _exc)
    raise

from dynamod.integrations.verl import cpu_platform  # noqa: E402  (verl checked first)


def _load_replica() -> type:
    from dynamod.integrations.verl.replica import DynamodReplica

    return DynamodReplica


def register() -> None:
    """Register the replica and the server adapter with verl (idempotent)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER


cpu_platform.install()
register()
