"""The CPU preflight (pure): a verl config that cannot run here is refused naming the key
and the fix; one that can passes."""

from __future__ import annotations

from typing import Any

import pytest

from dynamod.integrations.verl.errors import RolloutConfigError
from dynamod.integrations.verl.preflight import RayOffer, check, offer_of

STACK = RayOffer(cpus=8, gpus=2, where="the stack's var ray_num_cpus",
                 gpus_where="the stack's var ray_num_gpus")


def config(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trainer": {"device": "cpu", "n_gpus_per_node": 2, "nnodes": 1},
        "actor_rollout_ref": {
            "rollout": {"name": "dynamod"},
            "model": {"override_config": {"attn_implementation": "sdpa"}},
        },
        "ray_kwargs": {"ray_init": {"address": "127.0.0.1:1234"}},
    }
    for dotted, value in over.items():
        node = base
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return base


def refused(cfg: dict[str, Any], offer: RayOffer | None = STACK) -> RolloutConfigError:
    with pytest.raises(RolloutConfigError) as info:
        check(cfg, offer)
    return info.value


def test_a_runnable_config_passes() -> None:
    check(config(), STACK)


def test_cuda_without_a_gpu() -> None:
    error = refused(config(trainer__device="cuda"))
    assert error.key == "trainer.device" and "set trainer.device=cpu" in error.reason


def test_another_rollout() -> None:
    error = refused(config(actor_rollout_ref__rollout__name="vllm"))
    assert error.key == "actor_rollout_ref.rollout.name"
    assert "actor_rollout_ref.rollout.name=dynamod" in error.reason


def test_flash_attention_default() -> None:
    cfg = config()
    del cfg["actor_rollout_ref"]["model"]
    error = refused(cfg)
    assert error.key.endswith("attn_implementation") and "=sdpa" in error.reason


def test_too_few_ray_cpus_for_the_ranks() -> None:
    error = refused(config(), RayOffer(4, 2, "the stack's var ray_num_cpus", "x"))
    assert error.key == "trainer.n_gpus_per_node"
    assert "need 7 Ray CPUs" in error.reason and "ray_num_cpus to 7" in error.reason


def test_too_few_logical_gpus() -> None:
    error = refused(config(trainer__n_gpus_per_node=3))
    assert "3 logical GPU(s)" in error.reason and "ray_num_gpus to 3" in error.reason


def test_a_layout_across_nodes_is_judged_by_what_each_node_offers() -> None:
    """A cluster's Ray head and workers each offer the stack's ray_num_gpus: 2 nodes of 1
    rank need 1 logical GPU a node, not 2 from the head."""
    one_a_node = RayOffer(4, 1, "the stack's var ray_num_cpus", "the stack's var ray_num_gpus")
    check(config(trainer__n_gpus_per_node=1, trainer__nnodes=2), one_a_node)
    error = refused(config(trainer__n_gpus_per_node=2, trainer__nnodes=2), one_a_node)
    assert "2 trainer rank(s) a node need 2 logical GPU(s)" in error.reason
    assert "it offers 1 a node" in error.reason


def test_local_ray_offer_comes_from_ray_init() -> None:
    cfg = config(ray_kwargs__ray_init={"num_cpus": 3, "num_gpus": 1})
    offer = offer_of(cfg, cpu_count=2, stack_offer=None)
    assert offer == RayOffer(3, 1, "+ray_kwargs.ray_init.num_cpus", "+ray_kwargs.ray_init.num_gpus")
    error = refused(config(trainer__n_gpus_per_node=1), offer)
    assert "need 4 Ray CPUs" in error.reason
    assert "+ray_kwargs.ray_init.num_cpus to 4" in error.reason


def test_a_joined_cluster_that_is_not_the_stack_is_not_judged() -> None:
    assert offer_of(config(), cpu_count=2, stack_offer=None) is None
    check(config(trainer__n_gpus_per_node=64), None)
