"""The stock stacks validate with `dynamod check`, the GPU one included (it cannot run
here: no GPU, no vLLM)."""

from __future__ import annotations

import json

import pytest

from dynamod.core import spec
from dynamod.core.paths import units_dir
from dynamod.core.ports import PortAllocator
from dynamod.rollout import policy_table
from dynamod.rollout.policy_table import policy_of
from dynamod.rollout.worker_table import worker_of
from tests.conftest import Dynamod


@pytest.mark.parametrize("stack", ["infra", "local", "verl-dynamo"])
def test_check_passes(dm: Dynamod, stack: str) -> None:
    result = dm.run("check", stack, check=True)
    assert f"stack '{stack}' is valid" in result.stdout


def test_verl_dynamo_shards_get_stable_ports_and_one_gpu_each(tmp_path: object) -> None:
    stack = spec.load(units_dir() / "stacks" / "verl-dynamo.toml", state_dir=units_dir(),
                      allocate_port=PortAllocator(), var_overrides={"shards": 4})
    shards = [stack.units[f"worker@{i}"] for i in range(4)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in shards] == ["0", "1", "2", "3"]
    assert all(s.env["PYTHONHASHSEED"] == "0" for s in shards)
    for name in ("system", "kv_events", "vllm"):
        ports = [s.ports[name] for s in shards]
        assert ports == list(range(ports[0], ports[0] + 4)), name  # fixed base + index
    assert all(s.ports["system"] <= 32767 for s in shards)
    for s in shards:
        kv = json.loads(s.command[s.command.index("--kv-events-config") + 1])
        assert kv["endpoint"].endswith(f":{s.ports['kv_events']}")
        assert (w := worker_of(s)) is not None and w.system_url.endswith(f":{s.ports['system']}")
        assert s.depends_on["kv-metrics"] == "started"
    frontend = stack.units["frontend"]
    assert "--router-mode" in frontend.command
    assert frontend.command[frontend.command.index("--router-mode") + 1] == "kv"
    assert frontend.ready is not None and getattr(frontend.ready, "min_instances", 0) == 4
    assert policy_of(stack) is not None and policy_table.shards(stack) == [s.name for s in shards]
