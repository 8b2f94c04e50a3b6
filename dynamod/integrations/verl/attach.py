"""Finding the stack: its state dir (setting, else DYNAMOD_STATE_DIR) and how verl's driver
joins the stack's Ray head.

The Ray head unit runs with DYNAMOD_STATE_DIR set, so every actor verl starts on it finds
the stack without configuration; a driver outside it names the state dir in
`engine_kwargs.dynamod.state_dir` or the environment. Ray turns a loopback address into
the host's routable one unless "clusters" are off, so a driver must set
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before it imports ray, as the head unit does; a
cluster's Ray head (units/cluster/ray-head.toml) is on its node's address, with "clusters"
on (`ray_env`). On a cluster every node's daemon has a state dir of its own, and a process
on a node finds its own by its address (`node_state_dir`).
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
RAY_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def ray_env(ray_address: str | None) -> dict[str, str]:
    """What a driver sets before it imports ray: loopback for a stack's loopback head, the
    node's address for a cluster's head (units/cluster/ray-head.toml), as its units do."""
    host = (ray_address or "127.0.0.1").rsplit(":", 1)[0]
    return RAY_LOOPBACK_ENV if host.startswith("127.") else RAY_CLUSTER_ENV


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
    view = read_stack(state_dir)
    for key, value in ray_env(view.ray_address).items():
        os.environ.setdefault(key, value)
    if view.ray_address is None:
        raise StackNotReadyError(
            f"dynamod stack {view.stack!r} has no `ray-head` unit; use units/stacks/verl-cpu.toml"
            " or a stack that includes units/ray-head.toml"
        )
    return {
        "address": view.ray_address,
        "runtime_env": {"env_vars": {STATE_DIR_ENV: str(state_dir)}},
    }
