"""A verl config that cannot run on this CPU machine, refused before Ray starts.

verl 0.9.1 finds most of these late: a `cuda` device with no GPU fails inside a Ray
worker, a rollout other than dynamod has no CPU engine, too few Ray CPUs or logical GPUs
for the trainer ranks leave the placement group pending for ever, FlashAttention fails
at model load. `check(config, ray)` names the first such key and its fix; the plugin
runs it from `auto_set_device`, which `main_ppo` calls on the parsed config before
`ray.init`, and exits with status 2 and that one line.

Pure: `config` is a mapping (verl's OmegaConf config works), `ray` what Ray will offer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamod.integrations.verl import ROLLOUT_NAME
from dynamod.integrations.verl.errors import RolloutConfigError

# verl's ResourcePoolManager asks for a bundle of {"CPU": 3, "GPU": 1} per trainer rank
# (max_colocate_count=3: actor, rollout, reward), and its TaskRunner needs one CPU to start.
CPUS_PER_RANK = 3
DRIVER_CPUS = 1
FLASH = ("flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class RayOffer:
    """What the Ray cluster verl will use offers, and where that is set."""

    cpus: float
    gpus: float
    where: str  # the key or stack var that sets it, for the fix
    gpus_where: str


def get(config: Any, dotted: str, default: Any = None) -> Any:
    """`config`'s value at the dotted key (mappings or attributes); `default` if unset."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return default if node is None else node


def ranks_of(config: Any) -> int:
    """The trainer ranks on one node: Ray offers its resources node by node (a cluster
    stack's Ray head and workers each offer the stack's `ray_num_gpus`), and verl asks
    each node for `n_gpus_per_node` of them."""
    return int(get(config, "trainer.n_gpus_per_node", 1))


def check(config: Any, ray: RayOffer | None) -> None:
    """RolloutConfigError naming the first key that cannot work on CPU."""
    device = str(get(config, "trainer.device", "cuda"))
    if device != "cpu":
        raise RolloutConfigError(
            "trainer.device",
            f"{device!r} but this machine has no GPU (verl's platform here is cpu); "
            "set trainer.device=cpu",
        )
    name = str(get(config, "actor_rollout_ref.rollout.name", ""))
    if name != ROLLOUT_NAME:
        raise RolloutConfigError(
            "actor_rollout_ref.rollout.name",
            f"{name!r} has no CPU engine in verl; set actor_rollout_ref.rollout.name="
            f"{ROLLOUT_NAME} and run a dynamod stack (dynamod up units/stacks/verl-cpu.toml)",
        )
    attn = str(get(config, "actor_rollout_ref.model.override_config.attn_implementation",
                    FLASH[0]))
    if attn in FLASH:
        raise RolloutConfigError(
            "actor_rollout_ref.model.override_config.attn_implementation",
            f"{attn!r} (verl's default) needs a GPU; set "
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        )
    if ray is None:
        return
    ranks = ranks_of(config)
    on = " a node" if int(get(config, "trainer.nnodes", 1)) > 1 else ""
    if ray.gpus < ranks:
        raise RolloutConfigError(
            "trainer.n_gpus_per_node",
            f"{ranks} trainer rank(s){on} need {ranks} logical GPU(s) from Ray (one per "
            f"rank, even on CPU), but it offers {ray.gpus:g}{on}; set {ray.gpus_where} to "
            f"{ranks} or lower trainer.n_gpus_per_node",
        )
    needed = ranks * CPUS_PER_RANK + DRIVER_CPUS
    if ray.cpus < needed:
        raise RolloutConfigError(
            "trainer.n_gpus_per_node",
            f"{ranks} trainer rank(s){on} need {needed} Ray CPUs ({CPUS_PER_RANK} per rank + "
            f"{DRIVER_CPUS} for verl's TaskRunner), but Ray offers {ray.cpus:g}{on}; set "
            f"{ray.where} to {needed} (Ray's CPUs are logical) or lower trainer.n_gpus_per_node",
        )


def offer_of(config: Any, cpu_count: int, stack_offer: RayOffer | None) -> RayOffer | None:
    """What Ray will offer: the dynamod stack's head when main_ppo joins it (`stack_offer`,
    matched by address), else the local cluster `ray.init` starts; None when unknown."""
    address = get(config, "ray_kwargs.ray_init.address")
    if address:
        return stack_offer
    return RayOffer(
        cpus=float(get(config, "ray_kwargs.ray_init.num_cpus", cpu_count)),
        gpus=float(get(config, "ray_kwargs.ray_init.num_gpus", 0)),
        where="+ray_kwargs.ray_init.num_cpus",
        gpus_where="+ray_kwargs.ray_init.num_gpus",
    )
