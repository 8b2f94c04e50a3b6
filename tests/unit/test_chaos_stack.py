"""The chaos runner's view of a stack, pure parts: which model a shard serves, read from
its command line (our CPU worker's flag and dynamo.vllm's)."""

from __future__ import annotations

from dynamod.chaos.stack import served_model_name


def test_the_served_model_is_read_from_either_engines_flag() -> None:
    ours = ["python", "-m", "dynamod.workers.cpu", "--model-name", "mine", "--port", "1"]
    real = ["python", "-m", "dynamo.vllm", "--model", "/m", "--served-model-name", "theirs"]
    assert served_model_name(ours) == "mine"
    assert served_model_name(real) == "theirs"
    assert served_model_name(["python", "-m", "dynamo.vllm", "--model", "/m"]) == "tiny-cpu"
    assert served_model_name(["x", "--served-model-name"], default="d") == "d"  # no value
