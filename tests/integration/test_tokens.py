"""Real tokens on the real stack: etcd, NATS, the Dynamo frontend (kv router) and three
CPU workers generating with the tiny Llama. Same seed and weights give the same tokens
on every shard; a weight push changes them and they match the new weights' logprobs; a
flush empties the prefix cache; a shard that lies about its weights is caught by its
outputs (`dynamod.trainer.shard_check`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.trainer.boundary import LOGPROB_TOLERANCE
from dynamod.trainer.shard_check import check_shard_outputs, sample_shard
from dynamod.workers.model import ensure_model
from dynamod.workers.weights import WEIGHTS_FILE, state_dict_digest
from tests.integration.rawstack import RawStack, Worker, http_json, raw_stack

pytestmark = pytest.mark.slow

MODEL = "tiny-cpu"
PROMPT = [1, *range(40, 80)]  # 41 tokens: two full 16-token blocks are cacheable
SEED = 77


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawStack]:
    with raw_stack(tmp_path_factory.mktemp("stack"), namespace="tokens") as stack:
        stack.start_etcd()
        stack.start_nats()
        stack.start_frontend(router_mode="kv")
        yield stack


@pytest.fixture(scope="module")
def shards(stack: RawStack, model_dir: Path) -> dict[str, Worker]:
    """Two honest shards and one that keeps serving the weights of the update before."""
    extra = ["--block-size", "16", "--initial-version", "0"]
    workers = {
        "a": stack.start_worker("worker-a", model_dir, MODEL, extra=extra),
        "b": stack.start_worker("worker-b", model_dir, MODEL, extra=extra),
        "stale": stack.start_worker(
            "worker-stale", model_dir, MODEL, extra=[*extra, "--test-serve-previous-weights"]
        ),
    }
    stack.wait_model(MODEL)
    return workers


def instance_id(worker: Worker) -> int:
    return int(worker.engine("liveness_probe")[1]["instance_id"])


def wait_routable(stack: RawStack, workers: list[Worker], timeout: float = 30) -> None:
    """Until the frontend can pin a request to each worker (it has discovered them all)."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        while True:
            try:
                sample_shard(stack.frontend_url, MODEL, instance_id(worker), [1, 2], 0, 1)
                break
            except Exception:
                assert time.monotonic() < deadline, f"{worker.proc.name} never routable"
                time.sleep(0.2)


def push(workers: list[Worker], path: Path, version: int) -> None:
    for worker in workers:
        assert worker.engine("pause_generation")[1]["status"] == "ok"
        reply = worker.engine(
            "update_weights_from_disk", {"model_path": str(path), "weight_version": version}
        )[1]
        assert reply["status"] == "ok", reply
        assert worker.engine("resume_generation")[1]["status"] == "ok"


def perturbed_checkpoint(path: Path, model_dir: Path, seed: int) -> str:
    """The model's tensors plus small seeded noise (as one optimiser step would move them)."""
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: t + 0.01 * torch.randn(t.shape, generator=generator)
        for name, t in sorted(load_file(str(model_dir / WEIGHTS_FILE)).items())
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    return state_dict_digest(tensors)


def completion(stack: RawStack, worker: Worker, prompt: list[int], **extra: Any) -> Any:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "seed": SEED,
        "logprobs": 0,
        "ignore_eos": True,
        "nvext": {
            "backend_instance_id": instance_id(worker),
            "extra_fields": ["completion_token_ids", "engine_data"],
        },
        **extra,
    }
    status, reply = http_json("POST", f"{stack.frontend_url}/v1/completions", body, timeout=60)
    assert status == 200, reply
    return reply


def test_same_seed_and_weights_give_the_same_tokens_on_every_shard(
    stack: RawStack, shards: dict[str, Worker]
) -> None:
    workers = list(shards.values())
    wait_routable(stack, workers)
    outputs = [
        sample_shard(stack.frontend_url, MODEL, instance_id(w), PROMPT, SEED, 12) for w in workers
    ]
    assert len(outputs[0].token_ids) == 12
    assert all(o.token_ids == outputs[0].token_ids for o in outputs), [o.token_ids for o in outputs]
    for o in outputs:
        assert len(o.logprobs) == 12
        diffs = [abs(x - y) for x, y in zip(o.logprobs, outputs[0].logprobs, strict=True)]
        assert max(diffs) < 1e-5
    first = instance_id(workers[0])
    other_seed = sample_shard(stack.frontend_url, MODEL, first, PROMPT, SEED + 1, 12)
    assert other_seed.token_ids != outputs[0].token_ids, "the seed must matter"


def test_flush_cache_drops_the_hit_rate_to_zero_and_it_recovers(
    stack: RawStack, shards: dict[str, Worker]
) -> None:
    worker = shards["a"]
    prompt = [1, *range(200, 240)]

    def cached(reply: Any) -> int:
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)

    completion(stack, worker, prompt)
    assert cached(completion(stack, worker, prompt)) == 32  # two full blocks of 41 tokens
    cache = worker.engine("liveness_probe")[1]["prefix_cache"]
    assert cache["blocks"] >= 2 and cache["hit_tokens"] >= 32

    assert worker.engine("flush_cache")[1]["status"] == "ok"
    flushed = worker.engine("liveness_probe")[1]["prefix_cache"]
    assert flushed["blocks"] == 0
    assert cached(completion(stack, worker, prompt)) == 0  # hit rate of this request: 0
    after_miss = worker.engine("liveness_probe")[1]["prefix_cache"]
    assert after_miss["hit_tokens"] == flushed["hit_tokens"]
    assert cached(completion(stack, worker, prompt)) == 32  # it recovers on a repeat
    assert worker.engine("liveness_probe")[1]["prefix_cache"]["hit_tokens"] == (
        flushed["hit_tokens"] + 32
    )


def test_a_push_changes_outputs_to_the_new_weights_and_a_stale_shard_is_caught(
    stack: RawStack, shards: dict[str, Worker], model_dir: Path, tmp_path: Path
) -> None:
    workers = list(shards.values())
    wait_routable(stack, workers)
    ids = {name: instance_id(w) for name, w in shards.items()}
    before = {
        name: sample_shard(stack.frontend_url, MODEL, ids[name], PROMPT, SEED, 12)
        for name in shards
    }
    for name in shards:  # at the boot weights, every shard passes the check
        check = check_shard_outputs(stack.frontend_url, MODEL, ids[name], model_dir)
        assert check.matches, str(check)

    step1 = tmp_path / "step-1"
    digest = perturbed_checkpoint(step1, model_dir, seed=1)
    push(workers, step1, version=1)
    for worker in workers:  # every shard claims the new weights
        reported = worker.engine("get_weight_version")[1]
        assert (reported["version"], reported["digest"]) == (1, digest)

    for name in ("a", "b"):
        after = sample_shard(stack.frontend_url, MODEL, ids[name], PROMPT, SEED, 12)
        assert after.logprobs != before[name].logprobs, "the push did not change the outputs"
        assert after.token_ids != before[name].token_ids
        new = check_shard_outputs(stack.frontend_url, MODEL, ids[name], model_dir, step1)
        assert new.matches, str(new)
        assert new.max_abs_diff <= LOGPROB_TOLERANCE
        old = check_shard_outputs(stack.frontend_url, MODEL, ids[name], model_dir)
        assert not old.matches, "an updated shard's outputs must not pass for the old weights"

    # The stale shard reports version 1 and step-1's digest, but its outputs say otherwise.
    stale = check_shard_outputs(stack.frontend_url, MODEL, ids["stale"], model_dir, step1)
    assert not stale.matches, str(stale)
    assert stale.max_abs_diff > 10 * LOGPROB_TOLERANCE
    assert stale.reported_digest == digest
    assert check_shard_outputs(stack.frontend_url, MODEL, ids["stale"], model_dir).matches

    # One more push: the stale shard now serves step-1 (one version behind).
    step2 = tmp_path / "step-2"
    perturbed_checkpoint(step2, model_dir, seed=2)
    push(workers, step2, version=2)
    url = stack.frontend_url
    assert not check_shard_outputs(url, MODEL, ids["stale"], model_dir, step2).matches
    assert check_shard_outputs(url, MODEL, ids["stale"], model_dir, step1).matches
    assert check_shard_outputs(url, MODEL, ids["a"], model_dir, step2).matches


def test_a_stop_string_ends_the_completion(stack: RawStack, shards: dict[str, Worker]) -> None:
    """The frontend applies `stop` strings to what the engine streams, and stops it.
    (Not with `ignore_eos`: Dynamo then ignores stop strings too.)"""
    worker = shards["a"]
    first = completion(stack, worker, PROMPT, max_tokens=24, ignore_eos=False)
    texts = first["choices"][0]["logprobs"]["tokens"]
    k = next(i for i, t in enumerate(texts) if i > 0 and t.strip().isalpha() and len(t) > 2)
    stopped = completion(stack, worker, PROMPT, max_tokens=24, ignore_eos=False, stop=[texts[k]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert texts[k] not in stopped["choices"][0]["text"]  # the stop string is not returned
    ids = first["nvext"]["completion_token_ids"]
    assert stopped["nvext"]["completion_token_ids"] == ids[: k + 1]  # the same tokens, cut
