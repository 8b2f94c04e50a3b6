"""Which verl versions the integration supports, checked before anything registers.

verl's plug-in points (`RolloutReplicaRegistry`, `_ROLLOUT_REGISTRY`, the replica's
`init_*` / `launch_servers` contract and `TokenOutput`) are internals that move between
releases, so the module refuses any verl it was not tested against rather than
registering something that breaks half-way through a training run.
"""

from __future__ import annotations

from importlib import metadata

from dynamod.integrations.verl.errors import UnsupportedVerlError

SUPPORTED_VERL_VERSIONS = ("0.9.1",)


def check_verl_version(installed: str | None) -> str:
    """`installed` if supported; otherwise UnsupportedVerlError naming the supported ones."""
    supported = ", ".join(SUPPORTED_VERL_VERSIONS)
    if installed is None:
        raise UnsupportedVerlError(
            f"verl is not installed; dynamod's verl rollout backend supports verl {supported} "
            "(pip install -e '.[verl]')"
        )
    if installed not in SUPPORTED_VERL_VERSIONS:
        raise UnsupportedVerlError(
            f"verl {installed} is not supported by dynamod.integrations.verl; supported: "
            f"{supported} (pip install 'verl=={SUPPORTED_VERL_VERSIONS[-1]}')"
        )
    return installed


def installed_verl_version() -> str | None:
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None
