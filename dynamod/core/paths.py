"""Where things live: the state dir, its socket, logs, and the stock unit files."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "DYNAMOD_STATE_DIR"
_SOCKET_MAX = 107  # sun_path is 108 bytes including the NUL


def default_state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "dynamod"
    return Path.home() / ".local" / "state" / "dynamod"


def cache_dir() -> Path:
    """Rebuildable artefacts shared by every stack (the tiny CPU model)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynamod"


def socket_path(state_dir: Path) -> Path:
    return state_dir.absolute() / "dynamod.sock"


def check_socket_path(state_dir: Path) -> str | None:
    path = str(socket_path(state_dir))
    if len(path.encode()) > _SOCKET_MAX:
        return (
            f"state dir {state_dir} is too deep for a unix socket path "
            f"({len(path)} > {_SOCKET_MAX} bytes); pick a shorter --state-dir"
        )
    return None


def units_dir() -> Path:
    """The stock `units/` folder that ships next to the package."""
    override = os.environ.get("DYNAMOD_UNITS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "units"


def resolve_stack_path(stack: str | None) -> Path:
    """A path to a stack file, or a stock stack name (`local`, `infra`)."""
    if stack is None:
        return units_dir() / "stacks" / "local.toml"
    candidate = Path(stack)
    if candidate.suffix == ".toml" or candidate.exists() or "/" in stack:
        return candidate
    return units_dir() / "stacks" / f"{stack}.toml"
