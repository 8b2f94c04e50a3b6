"""Finding the stack: its state dir (setting, else DYNAMOD_STATE_DIR) and how verl's driver
joins the stack's Ray head.

The Ray head unit runs with DYNAMOD_STATE_DIR set, so every actor verl starts on it finds
the stack without configuration; a driver outside it names the state dir in
`engine_kwargs.dynamod.state_dir` or the environment. Ray turns a loopback address into
the host's routable one unless "clusters" are off, so a driver must set
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before it imports ray, as the head unit does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dynamod.core.paths import STATE_DIR_ENV
from dynamod.integrations.verl.config import PREFIX, RolloutSettings
from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.stack import read_stack

RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def state_dir_of(settings: RolloutSettings) -> Path:
    if settings.state_dir is not None:
        return settings.state_dir
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env)
    raise StackNotReadyError(
        f"verl rollout backend 'dynamod' does not know which dynamod stack to attach to: set "
        f"{PREFIX}.dynamod.state_dir or {STATE_DIR_ENV} (the state dir given to `dynamod up`)"
    )


def node_state_dir(state_dir: Path, address: str | None = None) -> Path:
    """The state dir of the dynamod daemon on this process's node: on a cluster stack the
    one its node's registry entry names (the node at `address`, default this Ray worker's
    node address), else `state_dir`. verl gives every rank one state dir, the head's; a
    rank on another node must call its own node's daemon, which lists that node's shards
    (their system ports are on that node's loopback)."""
    view = read_stack(state_dir)
    if not view.nodes:
        return state_dir
    if address is None:
        import ray

        if ray.is_initialized():
            address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    for node in view.nodes:
        if node.address == address and node.state_dir is not None:
            return Path(node.state_dir)
    return state_dir


def ray_init_kwargs(state_dir: Path) -> dict[str, Any]:
    """`ray.init(**ray_init_kwargs(d))` joins the stack's Ray head (environment first)."""
    for key, value in RAY_LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    view = read_stack(state_dir)
    if view.ray_address is None:
        raise StackNotReadyError(
            f"dynamod stack {view.stack!r} has no `ray-head` unit; use units/stacks/verl-cpu.toml"
            " or a stack that includes units/ray-head.toml"
        )
    return {
        "address": view.ray_address,
        "runtime_env": {"env_vars": {STATE_DIR_ENV: str(state_dir)}},
    }
