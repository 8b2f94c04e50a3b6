"""The pure-torch Llama (the trainer's) against `transformers.LlamaForCausalLM`, same weights.

Logits must agree to float32 rounding for a full prefill, a prefill on a cached prefix and
a batched left-padded decode step, on the tiny model the builder writes and on a random
grouped-query config with biases; configs and weights it does not implement are refused;
greedy generation through the worker's NumpyEngine gives HF's greedy tokens (the numpy
model is held to this one in test_numpy_llama.py); and the serving path imports neither
transformers nor torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from dynamod.trainer.learner import Learner
from dynamod.trainer.scoring import completion_logprobs, load_policy
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.llama import Llama, LlamaConfig
from dynamod.workers.cpu.numpy_engine import NumpyEngine
from dynamod.workers.weights import load_checkpoint
from tests.unit.llama_configs import RANDOM_GQA

ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def tiny_pair(model_dir: Path) -> tuple[Llama, Any]:
    tensors = dict(load_checkpoint(model_dir).tensors)
    hf = LlamaForCausalLM(HFConfig.from_json_file(str(model_dir / "config.json")))
    hf.load_state_dict(tensors, strict=True)
    return Llama.from_dir(model_dir, tensors), hf.eval()


def random_pair(tmp_path: Path) -> tuple[Llama, Any]:
    (tmp_path / "config.json").write_text(json.dumps(RANDOM_GQA))
    hf = LlamaForCausalLM(HFConfig.from_json_file(str(tmp_path / "config.json")))
    generator = torch.Generator().manual_seed(7)
    tensors = {
        name: torch.randn(t.shape, generator=generator) * 0.3 for name, t in hf.state_dict().items()
    }
    hf.load_state_dict(tensors, strict=True)
    return Llama.from_dir(tmp_path, tensors), hf.eval()


@pytest.fixture(params=["tiny", "random-gqa"])
def pair(request: pytest.FixtureRequest, tiny_dir: Path, tmp_path: Path) -> tuple[Llama, Any]:
    return tiny_pair(tiny_dir) if request.param == "tiny" else random_pair(tmp_path)


def prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, length), generator=generator)


def hf_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


# ---------------------------------------------------------------- equivalence


@torch.inference_mode()
def test_full_prefill_matches_transformers(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    ids = prompt(37, ours.config.vocab_size, seed=1)
    logits, kv = ours(ids)
    expected = hf(input_ids=ids, use_cache=True)
    torch.testing.assert_close(logits, expected.logits, atol=ATOL, rtol=0)
    for (keys, values), (hf_keys, hf_values) in zip(
        kv, hf_kv(expected.past_key_values), strict=True
    ):
        torch.testing.assert_close(keys, hf_keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(values, hf_values, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_prefill_on_cached_prefix_matches_transformers(pair: tuple[Llama, Any]) -> None:
    ours, hf = pair
    ids = prompt(29, ours.config.vocab_size, seed=2)
    _, prefix_kv = ours(ids[:, :16])
    logits, kv = ours(ids[:, 16:], past=prefix_kv)
    expected = hf(input_ids=ids).logits[:, 16:]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert kv[0][0].shape[2] == 29


@torch.inference_mode()
def test_batched_padded_decode_matches_transformers(pair: tuple[Llama, Any]) -> None:
    """Rows of 5, 11 and 8 tokens left-padded to 11, one token each at its own position."""
    ours, hf = pair
    vocab = ours.config.vocab_size
    rows = [prompt(n, vocab, seed=10 + n)[0] for n in (5, 11, 8)]
    nxt = torch.tensor([[3], [4], [5]])
    longest = max(len(r) for r in rows)
    kvs = [ours(r[None])[1] for r in rows]
    past = []
    for layer in range(ours.config.num_hidden_layers):
        shape = (len(rows), *kvs[0][layer][0].shape[1:2], longest, kvs[0][layer][0].shape[3])
        keys, values = torch.zeros(shape), torch.zeros(shape)
        for i, (kv, row) in enumerate(zip(kvs, rows, strict=True)):
            keys[i, :, longest - len(row) :] = kv[layer][0][0]
            values[i, :, longest - len(row) :] = kv[layer][1][0]
        past.append((keys, values))
    mask = torch.zeros((len(rows), longest + 1), dtype=torch.long)
    for i, row in enumerate(rows):
        mask[i, longest - len(row) :] = 1
    positions = torch.tensor([[len(r)] for r in rows])
    logits, kv = ours(nxt, past=past, attention_mask=mask, position_ids=positions)
    for i, row in enumerate(rows):
        alone = hf(input_ids=torch.cat([row, nxt[i]])[None]).logits[0, -1]
        torch.testing.assert_close(logits[i, -1], alone, atol=ATOL, rtol=0)
    assert kv[0][0].shape[2] == longest + 1


@torch.inference_mode()
def test_right_padded_full_pass_matches_transformers(pair: tuple[Llama, Any]) -> None:
    """The trainer's shape: rows right-padded, positions from 0, padding masked."""
    ours, hf = pair
    ids = torch.cat([prompt(12, ours.config.vocab_size, seed=3)] * 2)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    logits, _ = ours(ids, attention_mask=mask)
    expected = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1, :7], expected[1, :7], atol=ATOL, rtol=0)
    assert torch.isfinite(logits).all()


def test_a_wrong_rotary_would_be_caught(tiny_dir: Path) -> None:
    """The comparison can fail: another rope base gives other logits."""
    ours, hf = tiny_pair(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0
    other = Llama(LlamaConfig.from_dict(config))
    other.load(ours.state_dict())
    ids = prompt(40, ours.config.vocab_size, seed=4)
    with torch.inference_mode():
        assert (other(ids)[0] - hf(input_ids=ids).logits).abs().max() > 1e-3


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (
            "rope_parameters",
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "rope_parameters",
        ),
        ("rope_scaling", {"type": "dynamic", "factor": 4.0}, "rope_scaling"),
        ("hidden_act", "gelu", "hidden_act"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
        ("num_key_value_heads", 4, "num_key_value_heads"),
        ("attention_bias", "yes", "attention_bias"),
        ("model_type", "mistral", "model_type"),
        ("dtype", "bfloat16", "dtype"),
    ],
)
def test_unsupported_config_is_refused(tmp_path: Path, field: str, value: Any, named: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RANDOM_GQA, field: value}))
    with pytest.raises(WorkerError) as caught:
        LlamaConfig.from_file(path)
    assert str(path) in str(caught.value)
    assert repr(named) in str(caught.value)


def test_transformers_4_rope_theta_field_is_read(tmp_path: Path) -> None:
    raw = {k: v for k, v in RANDOM_GQA.items() if k != "rope_parameters"}
    config = LlamaConfig.from_dict({**raw, "rope_theta": 123.0, "rope_scaling": None})
    assert config.rope_theta == 123.0


def test_null_key_value_heads_means_one_per_head() -> None:
    config = LlamaConfig.from_dict({**RANDOM_GQA, "num_key_value_heads": None})
    assert config.num_key_value_heads == config.num_attention_heads


def test_wrong_shaped_state_dict_is_refused(tiny_dir: Path) -> None:
    tensors = dict(load_checkpoint(tiny_dir).tensors)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(WorkerError, match=r"k_proj\.weight has shape \(64, 64\)"):
        Llama.from_dir(tiny_dir, tensors)


def test_missing_and_unexpected_tensors_are_refused(tiny_dir: Path) -> None:
    tensors = dict(load_checkpoint(tiny_dir).tensors)
    del tensors["lm_head.weight"]
    tensors["extra.bias"] = torch.zeros(3)
    with pytest.raises(WorkerError, match=r"missing lm_head\.weight; unexpected extra\.bias"):
        Llama.from_dir(tiny_dir, tensors)


# ---------------------------------------------------------------- the engine


async def engine_tokens(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    deaths: list[BaseException | None] = []
    engine = NumpyEngine(model_dir, load_checkpoint(model_dir, "numpy"), 4, 64, deaths.append)
    await engine.start()

    async def one(tokens: list[int]) -> list[int]:
        request = {
            "token_ids": tokens,
            "sampling_options": {"temperature": 0.0},
            "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
        }
        return [
            t for chunk in [c async for c in engine.generate(request)] for t in chunk["token_ids"]
        ]

    try:
        first = await asyncio.gather(*(one(p) for p in prompts))  # batched decode
        again = await one(prompts[0])  # the prefix cache now holds its blocks
        assert again == first[0]
        return list(first)
    finally:
        await engine.close()
        assert not deaths


def test_engine_greedy_matches_transformers_generate(tiny_dir: Path) -> None:
    prompts = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 40, 41], [1, 60, 61, 62, 63, 64]]
    got = asyncio.run(engine_tokens(tiny_dir, prompts, max_tokens=12))
    _, hf = tiny_pair(tiny_dir)
    for tokens, completion in zip(prompts, got, strict=True):
        expected = hf.generate(
            torch.tensor([tokens]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(tokens) :].tolist()
        assert completion == expected


# ---------------------------------------------------------------- the trainer


class HFPolicy:
    """transformers' model behind the trainer's calling convention (logits, kv)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[Any, None]:
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits, None


PROMPTS = [[1, 30, 31, 32, 33], [1, 40], [1, 50, 51]]
COMPLETIONS = [[60, 61, 62], [70, 71, 72, 73, 74, 75], [80]]


def test_trainer_scoring_matches_transformers(tiny_dir: Path) -> None:
    ours, pad_id = load_policy(tiny_dir)
    _, hf = tiny_pair(tiny_dir)
    got = completion_logprobs(ours, PROMPTS, COMPLETIONS, pad_id)
    expected = completion_logprobs(HFPolicy(hf), PROMPTS, COMPLETIONS, pad_id)
    assert [len(row) for row in got] == [len(c) for c in COMPLETIONS]
    for row, hf_row in zip(got, expected, strict=True):
        assert row == pytest.approx(hf_row, abs=ATOL, rel=0)


def test_learner_step_has_transformers_loss_and_gradients(tiny_dir: Path) -> None:
    learner = Learner(tiny_dir, lr=1e-3, seed=0)
    twin = Learner(tiny_dir, lr=1e-3, seed=0)
    _, hf = tiny_pair(tiny_dir)
    hf.train()
    twin.model = HFPolicy(hf)  # type: ignore[assignment]
    twin.optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    advantages = [1.0, -0.5, 0.25]
    loss = learner.step(PROMPTS, COMPLETIONS, advantages)
    assert loss == pytest.approx(twin.step(PROMPTS, COMPLETIONS, advantages), abs=ATOL)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, param in learner.model.named_parameters():
        assert param.grad is not None and hf_grads[name] is not None, name
        torch.testing.assert_close(param.grad, hf_grads[name], atol=ATOL, rtol=1e-4)
    assert any(
        float(p.grad.abs().max()) > 0 for p in learner.model.parameters() if p.grad is not None
    )


# ---------------------------------------------------------------- the import


# The probes' imports of Dynamo write a logging config into TMPDIR: the session's own
# (tests/conftest.py, removed at its end), not /tmp.
SERVING_PROBE = """
import asyncio, sys
from pathlib import Path
from dynamod.workers.cpu.serve import main  # what python -m dynamod.workers.cpu imports
from dynamod.workers.cpu.args import engine_args_for, parse_args
# what serve() imports of Dynamo before it serves
from dynamo.common.configuration.groups.router_args import build_router_config
from dynamo.llm import register_model
from dynamo.mocker.config import build_runtime_config
from dynamo.runtime import DistributedRuntime
numpy_before_args = "numpy" in sys.modules
{extra}

async def build() -> None:
    model_dir = Path(sys.argv[1])
    _, mocker = parse_args(["--engine", "numpy", "--model-path", str(model_dir)])
    build_runtime_config(engine_args_for(mocker))
    from dynamod.workers.cpu.numpy_engine import NumpyEngine
    from dynamod.workers.weights import load_checkpoint
    engine = NumpyEngine(model_dir, load_checkpoint(model_dir, "numpy"), 4, 8, print)
    await engine.start()
    await engine.close()

asyncio.run(build())
print(sorted(m for m in ("transformers", "torch") if m in sys.modules), numpy_before_args)
"""


SESSION_TMP = os.environ.get("TMPDIR", "/tmp")


def serving_imports(model_dir: Path, extra: str = "", path: str = "") -> str:
    """What the probe saw: the heavy modules loaded, and whether numpy came before the
    arguments (then --threads could not reach BLAS)."""
    done = subprocess.run(
        [sys.executable, "-c", SERVING_PROBE.format(extra=extra), str(model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            "PYTHONPATH": os.pathsep.join(filter(None, [path, str(ROOT)])),
            "PATH": "/usr/bin:/bin",
            "TMPDIR": SESSION_TMP,
        },
        timeout=120,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_serving_path_imports_neither_transformers_nor_torch(tiny_dir: Path) -> None:
    assert serving_imports(tiny_dir) == "[] False"


@pytest.mark.parametrize("module", ["transformers", "torch"])
def test_the_import_check_sees_a_module_when_it_is_imported(
    tiny_dir: Path, tmp_path: Path, module: str
) -> None:
    """As if a serving module imported it again (an empty stand-in: the real import costs
    seconds, and only its presence in sys.modules is under test)."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text("")
    assert serving_imports(tiny_dir, f"import {module}", str(tmp_path)) == f"['{module}'] False"


THREADS_PROBE = """
import sys
{before}
from dynamod.workers.cpu.args import set_blas_threads
set_blas_threads(int(sys.argv[1]))
import numpy
numpy.ones((64, 64)) @ numpy.ones((64, 64))
print(open("/proc/self/status").read().split("Threads:")[1].split()[0])
"""


def blas_probe(threads: int, before: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", THREADS_PROBE.format(before=before), str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TMPDIR": SESSION_TMP},
        timeout=60,
    )


def test_threads_reach_blas_and_numpy_loaded_too_early_is_refused() -> None:
    """OpenBLAS starts threads - 1 helpers when numpy loads (at most one per core): the
    process has `threads` threads. Unset, OpenBLAS would take every core."""
    cores = len(os.sched_getaffinity(0))
    counts = {n: blas_probe(n).stdout.strip() for n in {1, min(2, cores)}}
    assert counts == {n: str(n) for n in counts}
    early = blas_probe(1, before="import numpy")
    assert early.returncode != 0 and "numpy was imported before --threads" in early.stderr


def test_worker_refuses_an_unsupported_config_with_one_line_and_exit_2(
    tiny_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (model_dir / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "dynamod.workers.cpu", "--model-path", str(model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "DYN_SYSTEM_PORT": "20001",
            "TMPDIR": SESSION_TMP,
        },
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "dynamod.workers.cpu: error" in line]
    assert len(errors) == 1, done.stderr
    assert f"{model_dir / 'config.json'}: field 'rope_parameters'" in errors[0]
    assert "Traceback" not in done.stderr
