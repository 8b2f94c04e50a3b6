"""`DynamodReplica`: verl's RolloutReplica for a stack dynamod already runs.

It spawns nothing. `init_hybrid` (the trainer's worker group, colocated) and
`init_standalone` record the mode and go straight to `launch_servers`, which reads the
stack from dynamod, refuses it with a diagnosis when it is not up or has fewer admitted
shards than verl's layout has replicas (one shard at least per replica), refuses settings
that disagree with it, and starts this replica's `DynamodRolloutServer` actor: on a
cluster, on the Ray node at the address of its shards' node (`layout.py`), refused when
Ray runs none there. The server handle is what verl's load balancer and agent loop call;
the server address is the frontend's, the same for every replica: Dynamo's router
balances, not verl's.
"""

from __future__ import annotations

from typing import Any

import ray
import structlog
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from dynamod.integrations.verl.attach import state_dir_of
from dynamod.integrations.verl.config import SECTIONS, parse_settings
from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.layout import Placement, place
from dynamod.integrations.verl.server import DynamodRolloutServer
from dynamod.integrations.verl.stack import check_settings, diagnose, read_stack

log = structlog.get_logger("dynamod.integrations.verl")


class DynamodReplica(RolloutReplica):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine_kwargs = dict(self.config.engine_kwargs or {})
        self.settings = parse_settings(engine_kwargs)
        self.section = next((s for s in SECTIONS if engine_kwargs.get(s)), "dynamod")
        for key, reason in self.settings.ignored:
            log.warning("verl.setting_ignored", key=key, reason=reason)
        self.state_dir = state_dir_of(self.settings)
        self.replicas = self._layout(self.config.n_gpus_per_node * max(1, self.config.nnodes))

    def _layout(self, world_size: int) -> int:
        return max(1, int(world_size) // int(self.world_size))

    async def init_hybrid(self, worker_group: Any) -> None:
        self.replicas = self._layout(worker_group.world_size)
        await super().init_hybrid(worker_group)

    async def init_standalone(self) -> None:
        """The shards are dynamod's processes: no resource pool, no worker group."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        raise NotImplementedError(
            "rollout 'dynamod' attaches to shards dynamod runs; it has no colocated "
            "(separate-process, same placement group) mode: use hybrid or standalone"
        )

    async def launch_servers(self) -> None:
        view = read_stack(self.state_dir)
        diagnose(view, needed_shards=self.replicas)
        check_settings(view, self.settings, self.section)
        where = place(view, self.replica_rank, self.replicas)
        model = self.settings.served_model_name or view.model
        if model is None:
            raise RuntimeError(f"stack {view.stack!r}: cannot tell which model its shards serve")
        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": self.max_concurrency}
        if where.node is not None:
            options["scheduling_strategy"] = _on_node(where, self.replica_rank)
        actor: Any = ray.remote(DynamodRolloutServer).options(**options)
        server: Any = actor.remote(
            str(where.state_dir), self.settings, where.replica, where.replicas, model,
            where.frontend_url, self.config.prompt_length, self.config.response_length,
            bool(self.config.free_cache_engine), where.node,
        )
        await server.reach.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = where.frontend_url.removeprefix("http://")
        log.info(
            "verl.replica_attached", replica=self.replica_rank, replicas=self.replicas,
            mode=str(self.rollout_mode), stack=view.stack, frontend=where.frontend_url,
            node=where.node, state_dir=str(where.state_dir),
            policy_version=view.current_version,
        )


def _on_node(where: Placement, replica_rank: int) -> Any:
    """Ray's strategy that runs an actor on the live Ray node at `where`'s address."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    for node in alive:
        if node.get("NodeManagerAddress") == where.address:
            return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
    raise StackNotReadyError(
        f"rollout replica {replica_rank}'s shards are on cluster node {where.node} "
        f"({where.address}), where Ray runs no live node (Ray's: "
        f"{', '.join(sorted(str(n.get('NodeManagerAddress')) for n in alive)) or 'none'}); "
        "its server must run there: start units/ray-worker.toml on that node"
    )
