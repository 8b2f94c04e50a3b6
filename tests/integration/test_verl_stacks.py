"""The verl stacks validate with `dynamod check` (the GPU ones cannot run here) and have the
shape the integration guide asks for."""

from __future__ import annotations

import pytest

from dynamod.core import spec
from dynamod.core.paths import units_dir
from dynamod.core.ports import PortAllocator
from dynamod.rollout.policy_table import shards
from tests.conftest import Dynamod


@pytest.mark.parametrize("stack", ["verl-cpu", "verl-native", "verl-thunderagent"])
def test_check_passes(dm: Dynamod, stack: str) -> None:
    result = dm.run("check", stack, check=True)
    assert f"stack '{stack}' is valid" in result.stdout


def load(name: str) -> spec.Stack:
    return spec.load(units_dir() / "stacks" / f"{name}.toml", state_dir=units_dir(),
                     allocate_port=PortAllocator())


def test_native_stack_is_the_guides_training_layout() -> None:
    stack = load("verl-native")
    frontend = stack.units["frontend"].command
    assert frontend[frontend.index("--router-mode") + 1] == "kv"
    assert shards(stack) == ["worker@0", "worker@1"]
    assert [stack.units[s].env["CUDA_VISIBLE_DEVICES"] for s in shards(stack)] == ["0", "1"]
    ray = stack.units["ray-head"].command
    assert ray[ray.index("--num-gpus") + 1] == "2" and "--block" in ray
    assert "thunderagent-router" not in stack.units
    assert stack.units["worker@0"].depends_on["kv-metrics"] == "started"


def test_thunderagent_stack_starts_in_order_and_stops_in_reverse() -> None:
    stack = load("verl-thunderagent")
    order = stack.order
    for before, after in [("etcd", "nats"), ("nats", "worker@0"), ("kv-metrics", "worker@0"),
                          ("worker@1", "thunderagent-router"), ("thunderagent-router",
                                                                "frontend")]:
        assert order.index(before) < order.index(after), (before, after, order)
    assert stack.units["frontend"].depends_on["thunderagent-router"] == "ready"
    router = stack.units["thunderagent-router"].command
    assert router[router.index("--endpoint") + 1] == "dynamod.backend.generate"
    assert "--router-reset-states" not in router + stack.units["frontend"].command
    shard = stack.units["worker@0"].command
    assert shard[shard.index("--served-model-name") + 1].endswith("--dynamod-thunderagent-backend")
    assert shard[shard.index("--block-size") + 1] == router[router.index("--router-block-size") + 1]
    ready = stack.units["frontend"].ready
    assert ready is not None and getattr(ready, "min_instances", 0) == len(shards(stack)) + 1

