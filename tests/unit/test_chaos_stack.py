"""The chaos runner's view of a stack, pure parts: which model a shard serves, read from
its command line (our CPU worker's flag and dynamo.vllm's), and which etcd registrations
are the stack's own dead ones."""

from __future__ import annotations

from dynamod.chaos.stack import dead_registrations, served_model_name


def test_the_served_model_is_read_from_either_engines_flag() -> None:
    ours = ["python", "-m", "dynamod.workers.cpu", "--model-name", "mine", "--port", "1"]
    real = ["python", "-m", "dynamo.vllm", "--model", "/m", "--served-model-name", "theirs"]
    assert served_model_name(ours) == "mine"
    assert served_model_name(real) == "theirs"
    assert served_model_name(["python", "-m", "dynamo.vllm", "--model", "/m"]) == "tiny-cpu"
    assert served_model_name(["x", "--served-model-name"], default="d") == "d"  # no value


def test_a_dead_registration_counts_in_the_stacks_namespace_only() -> None:
    """Seen in test_real_engine: its reference CPU worker (namespace vllmref, on the
    stack's etcd) was called a registration of a dead instance of the stack."""
    def shard(pid: int | None, instance: int) -> dict[str, object]:
        return {"pid": pid, "dynamo": {"namespace": "vllm-cpu", "instance_ids": [instance]}}

    status = {"units": [shard(7, 255), shard(None, 16), {"name": "etcd", "pid": 3}]}
    keys = ["v1/instances/vllm-cpu/backend/generate/ff",       # worker@0's: alive
            "v1/instances/vllm-cpu/backend/generate/10",       # worker@1's: dead, left
            "v1/instances/vllmref/backend/generate/3e2a",      # someone else's namespace
            "v1/instances/vllm-cpu/backend/clear_kv_blocks/10"]  # not a worker endpoint
    assert dead_registrations(keys, status) == ["v1/instances/vllm-cpu/backend/generate/10"]
    # no namespace known: every worker key is judged
    bare = {"units": [{"name": "worker@0", "pid": 7, "dynamo": {"instance_ids": [255]}}]}
    assert dead_registrations(keys, bare) == [keys[1], keys[2]]
