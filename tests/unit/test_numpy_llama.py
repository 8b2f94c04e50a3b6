"""The worker's numpy Llama against the trainer's torch Llama (`llama.py`), same weights.

Logits and KV must agree within 1e-5 for a full prefill, a prefill on a cached prefix and
a batched left-padded decode step, on the tiny model the builder writes and on a random
grouped-query config with biases; a wrong rotary base would be caught; weights it cannot
hold are refused by name; greedy tokens through the NumpyEngine equal the torch model's
token-by-token argmax; and checkpoints loaded as numpy arrays digest exactly as the torch
tensors the trainer and the ledger digest.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dynamod.trainer.checkpoints import save_step
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.llama import Llama, LlamaConfig
from dynamod.workers.cpu.numpy_engine import NumpyEngine
from dynamod.workers.cpu.numpy_llama import NumpyLlama
from dynamod.workers.weights import (
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    state_dict_digest,
)
from tests.unit.llama_configs import RANDOM_GQA

ATOL = 1e-5


def tiny_pair(model_dir: Path) -> tuple[Llama, NumpyLlama]:
    torch_model = Llama.from_dir(model_dir, load_checkpoint(model_dir).tensors)
    return torch_model, NumpyLlama.from_dir(model_dir, load_checkpoint(model_dir, "numpy").tensors)


def random_pair(tmp_path: Path) -> tuple[Llama, NumpyLlama]:
    (tmp_path / "config.json").write_text(json.dumps(RANDOM_GQA))
    config = LlamaConfig.from_file(tmp_path / "config.json")
    generator = torch.Generator().manual_seed(7)
    tensors = {
        name: torch.randn(t.shape, generator=generator) * 0.3
        for name, t in Llama(config).state_dict().items()
    }
    arrays = {name: t.numpy() for name, t in tensors.items()}
    return Llama.from_dir(tmp_path, tensors), NumpyLlama.from_dir(tmp_path, arrays)


@pytest.fixture(params=["tiny", "random-gqa"])
def pair(request: pytest.FixtureRequest, tiny_dir: Path, tmp_path: Path) -> Any:
    return tiny_pair(tiny_dir) if request.param == "tiny" else random_pair(tmp_path)


def prompt(length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, vocab, (1, length), dtype=np.int64)


def close(ours: np.ndarray, theirs: torch.Tensor) -> None:
    np.testing.assert_allclose(ours, theirs.numpy(), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- equivalence


@torch.inference_mode()
def test_full_prefill_matches_the_torch_llama(pair: tuple[Llama, NumpyLlama]) -> None:
    torch_model, ours = pair
    ids = prompt(37, ours.config.vocab_size, seed=1)
    logits, kv = ours(ids)
    expected, expected_kv = torch_model(torch.from_numpy(ids))
    close(logits, expected)
    for (keys, values), (t_keys, t_values) in zip(kv, expected_kv, strict=True):
        close(keys, t_keys)
        close(values, t_values)


@torch.inference_mode()
def test_prefill_on_cached_prefix_matches_the_torch_llama(pair: tuple[Llama, NumpyLlama]) -> None:
    torch_model, ours = pair
    ids = prompt(29, ours.config.vocab_size, seed=2)
    _, prefix_kv = ours(ids[:, :16])
    logits, kv = ours(ids[:, 16:], past=prefix_kv)
    close(logits, torch_model(torch.from_numpy(ids))[0][:, 16:])
    assert kv[0][0].shape[2] == 29


@torch.inference_mode()
def test_batched_padded_decode_matches_the_torch_llama(pair: tuple[Llama, NumpyLlama]) -> None:
    """Rows of 5, 11 and 8 tokens left-padded to 11, one token each at its own position:
    each row's logits are the torch model's for that row alone."""
    torch_model, ours = pair
    vocab = ours.config.vocab_size
    rows = [prompt(n, vocab, seed=10 + n)[0] for n in (5, 11, 8)]
    nxt = np.array([[3], [4], [5]], dtype=np.int64)
    longest = max(len(r) for r in rows)
    kvs = [ours(r[None])[1] for r in rows]
    past = []
    for layer in range(ours.config.num_hidden_layers):
        shape = (len(rows), kvs[0][layer][0].shape[1], longest, kvs[0][layer][0].shape[3])
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for i, (kv, row) in enumerate(zip(kvs, rows, strict=True)):
            keys[i, :, longest - len(row) :] = kv[layer][0][0]
            values[i, :, longest - len(row) :] = kv[layer][1][0]
        past.append((keys, values))
    mask = np.zeros((len(rows), longest + 1), dtype=np.int64)
    for i, row in enumerate(rows):
        mask[i, longest - len(row) :] = 1
    positions = np.array([[len(r)] for r in rows], dtype=np.int64)
    logits, kv = ours(nxt, past=past, attention_mask=mask, position_ids=positions)
    for i, row in enumerate(rows):
        alone = torch_model(torch.from_numpy(np.concatenate([row, nxt[i]])[None]))[0][0, -1]
        close(logits[i, -1], alone)
    assert kv[0][0].shape[2] == longest + 1


def test_a_wrong_rotary_would_be_caught(tiny_dir: Path) -> None:
    """The comparison can fail: another rope base gives other logits."""
    torch_model, ours = tiny_pair(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0
    arrays = dict(load_checkpoint(tiny_dir, "numpy").tensors)
    other = NumpyLlama(LlamaConfig.from_dict(config), arrays, "test")
    ids = prompt(40, ours.config.vocab_size, seed=4)
    with torch.inference_mode():
        expected = torch_model(torch.from_numpy(ids))[0].numpy()
    assert np.abs(other(ids)[0] - expected).max() > 1e-3
    assert np.abs(ours(ids)[0] - expected).max() <= ATOL


# ---------------------------------------------------------------- refusals


def test_wrong_missing_and_unexpected_weights_are_refused_by_name(tiny_dir: Path) -> None:
    arrays = dict(load_checkpoint(tiny_dir, "numpy").tensors)
    arrays["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    del arrays["lm_head.weight"]
    arrays["extra.bias"] = np.zeros(3, np.float32)
    with pytest.raises(WorkerError) as caught:
        NumpyLlama.from_dir(tiny_dir, arrays)
    message = str(caught.value)
    assert "missing lm_head.weight; unexpected extra.bias" in message
    assert "k_proj.weight has shape (64, 64)" in message


def test_a_float64_weight_is_refused_by_name(tiny_dir: Path) -> None:
    arrays = dict(load_checkpoint(tiny_dir, "numpy").tensors)
    arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(np.float64)
    with pytest.raises(WorkerError, match=r"model\.norm\.weight is float64"):
        NumpyLlama.from_dir(tiny_dir, arrays)


def test_a_bfloat16_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    save_file(
        {"a": torch.ones(2), "b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / WEIGHTS_FILE)
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tmp_path, "numpy")
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / WEIGHTS_FILE) in message
    assert "tensor 'b' has dtype BF16" in message
    assert load_checkpoint(tmp_path).num_tensors == 2  # torch (the trainer) still loads it


# ---------------------------------------------------------------- digests


def test_numpy_and_torch_digests_are_equal_on_real_checkpoints(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The builder's checkpoint and one the trainer writes (`save_step`) after a change."""
    tensors = dict(load_checkpoint(tiny_dir).tensors)
    nudged = {name: t * 1.01 for name, t in tensors.items()}
    step = save_step(tmp_path / "ckpt", 3, nudged)
    digests = set()
    for checkpoint, source in ((tiny_dir, tensors), (step, nudged)):
        as_numpy = load_checkpoint(checkpoint, "numpy")
        as_torch = load_checkpoint(checkpoint)
        assert all(isinstance(a, np.ndarray) for a in as_numpy.tensors.values())
        assert as_numpy.digest == as_torch.digest == state_dict_digest(source)
        assert as_numpy.num_bytes == as_torch.num_bytes
        digests.add(as_numpy.digest)
    assert len(digests) == 2


def test_the_digest_tells_numpy_arrays_apart_as_it_tells_tensors() -> None:
    """Names, dtypes and shapes count for arrays too, not only the bytes; the layout
    (a non-contiguous view, big-endian storage) does not."""
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = state_dict_digest({"m": matrix})
    assert base == state_dict_digest({"m": torch.from_numpy(matrix.copy())})
    assert base == state_dict_digest({"m": matrix.T.copy().T})
    assert base == state_dict_digest({"m": matrix.astype(">f4")})
    others = {
        state_dict_digest({"n": matrix}),
        state_dict_digest({"m": matrix.reshape(4, 3)}),
        state_dict_digest({"m": matrix.view(np.int32)}),
        state_dict_digest({"m": matrix.astype(np.float64)}),
    }
    assert base not in others and len(others) == 4


# ---------------------------------------------------------------- the engine


async def engine_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> Any:
    deaths: list[BaseException | None] = []
    engine = NumpyEngine(model_dir, load_checkpoint(model_dir, "numpy"), 4, 64, deaths.append)
    await engine.start()

    async def one(tokens: list[int]) -> list[dict[str, Any]]:
        request = {
            "token_ids": tokens,
            "sampling_options": {"temperature": 0.0},
            "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
        }
        return [c async for c in engine.generate(request)]

    try:
        first = await asyncio.gather(*(one(p) for p in prompts))  # batched decode
        again = await one(prompts[0])  # the prefix cache now holds its blocks
        return first, again
    finally:
        await engine.close()
        assert not deaths


def test_engine_greedy_tokens_equal_the_torch_llamas(tiny_dir: Path) -> None:
    prompts = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 40, 41], [1, 60, 61, 62, 63, 64]]
    first, again = asyncio.run(engine_tokens(tiny_dir, prompts, max_tokens=12))
    torch_model, _ = tiny_pair(tiny_dir)
    for tokens, chunks in zip(prompts, first, strict=True):
        row = list(tokens)
        expected_logprobs = []
        with torch.inference_mode():
            for _ in range(12):
                logits = torch_model(torch.tensor([row]))[0][0, -1]
                row.append(int(torch.argmax(logits)))
                expected_logprobs.append(float(torch.log_softmax(logits, dim=-1)[row[-1]]))
        got = [t for c in chunks for t in c["token_ids"]]
        assert got == row[len(tokens) :]
        logprobs = [lp for c in chunks for lp in c["log_probs"]]
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert [t for c in again for t in c["token_ids"]] == [
        t for c in first[0] for t in c["token_ids"]
    ]
    usage = again[-1]["completion_usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 8  # two blocks of 4


@pytest.mark.parametrize("flag", ["--threads", "--torch-threads"])
def test_threads_below_one_are_refused(tmp_path: Path, flag: str) -> None:
    from dynamod.workers.cpu.args import parse_args

    with pytest.raises(WorkerError, match="--threads and --cache-blocks must be at least 1"):
        parse_args([flag, "0", "--model-path", str(tmp_path)])
    ours, _ = parse_args([flag, "3", "--model-path", str(tmp_path)])
    assert ours.threads == 3 and ours.engine == "numpy"


def test_a_hosted_extensions_tensors_arrive_as_numpy_and_bfloat16_is_refused() -> None:
    """verl's colocated path hands torch tensors to `load_weights`: kept as numpy arrays
    with the digest the trainer computes; a bfloat16 one is refused by name."""
    from dynamod.workers.cpu.extension import _CollectingModel

    model = _CollectingModel()
    sent = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    assert model.load_weights(sent.items()) == {"w", "b"}
    assert all(isinstance(a, np.ndarray) for a in model.received.values())
    assert state_dict_digest(model.received) == state_dict_digest(sent)
    with pytest.raises(WorkerError, match=r"weight 'h' has dtype torch\.bfloat16"):
        model.load_weights([("h", torch.ones(2, dtype=torch.bfloat16))])


async def stopped_at(model_dir: Path, prompt: list[int], stop: int) -> list[dict[str, Any]]:
    engine = NumpyEngine(model_dir, load_checkpoint(model_dir, "numpy"), 4, 64, print)
    await engine.start()
    request = {
        "token_ids": prompt,
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": 8, "stop_token_ids_hidden": [stop]},
    }
    try:
        return [c async for c in engine.generate(request)]
    finally:
        await engine.close()


def test_a_stop_token_is_returned_last_with_its_logprob(tiny_dir: Path) -> None:
    """As dynamo.vllm returns it through the frontend (seen: greedy [94, 94, 242], with
    stop_token_ids [94] the completion is [94] with one logprob, finish "stop"): a
    completion whose first token is a stop token is that one token, never empty (verl's
    trainer cannot batch an empty completion's missing logprobs)."""
    prompt = [1, 20, 21, 22, 23]
    first, _ = asyncio.run(engine_tokens(tiny_dir, [prompt], max_tokens=3))
    greedy = [t for c in first[0] for t in c["token_ids"]]
    chunks = asyncio.run(stopped_at(tiny_dir, prompt, greedy[0]))
    assert [t for c in chunks for t in c["token_ids"]] == greedy[:1]
    assert len([lp for c in chunks for lp in c["log_probs"]]) == 1
    assert chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 1
