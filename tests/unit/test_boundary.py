"""Boundary 1 and the trainer's logprob computation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from dynamod.trainer.boundary import LOGPROB_TOLERANCE, Scored, check
from dynamod.trainer.loop import Trainer, TrainerError
from dynamod.trainer.rollout import Completion
from dynamod.trainer.scoring import completion_logprobs


def test_matching_logprobs_pass_and_both_kinds_are_counted() -> None:
    report = check(
        [
            Scored([5, 6], [-1.0, -2.0], [-1.0 + 1e-6, -2.0], cancelled=False),
            Scored([7], [-0.5], [-0.5], cancelled=True),
            Scored([], None, [], cancelled=True),  # aborted before its first token
        ]
    )
    assert report.ok
    assert (report.terminal, report.cancelled, report.tokens) == (1, 2, 3)
    assert report.max_abs_diff == pytest.approx(1e-6, abs=1e-7)


@pytest.mark.parametrize(
    ("scored", "says"),
    [
        (Scored([5, 6], [-1.0, -2.1], [-1.0, -2.0], False), "token 1 (id 6)"),
        (Scored([5, 6], [-1.0], [-1.0, -2.0], False), "1 logprobs for 2 tokens"),
        (Scored([5, 6], None, [-1.0, -2.0], True), "(cancelled): no logprobs"),
        (Scored([5, 6], [-2.0, -1.0], [-1.0, -2.0], False), "token 0 (id 5)"),  # order
    ],
)
def test_a_mismatch_is_reported_with_where_it_is(scored: Scored, says: str) -> None:
    report = check([scored])
    assert not report.ok
    assert says in report.mismatches[0]


def test_the_tolerance_is_the_boundary() -> None:
    assert check([Scored([1], [-1.0], [-1.0 - LOGPROB_TOLERANCE / 2], False)]).ok
    assert not check([Scored([1], [-1.0], [-1.0 - LOGPROB_TOLERANCE * 2], False)]).ok


def tiny_llama() -> torch.nn.Module:
    """The trainer's model (the worker's Llama), randomly initialised."""
    from dynamod.workers.cpu.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig.from_dict(
        {
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "pad_token_id": 0,
        }
    )
    return Llama(config).eval()


def test_completion_logprobs_equal_a_token_by_token_computation() -> None:
    model = tiny_llama()
    prompts, completions = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10]]
    scored = completion_logprobs(model, prompts, completions, pad_id=0)
    for prompt, completion, got in zip(prompts, completions, scored, strict=True):
        assert len(got) == len(completion)
        row = prompt + completion
        for k, token in enumerate(completion):
            context = torch.tensor([row[: len(prompt) + k]])
            with torch.no_grad():
                logits = model(context)[0][0, -1]
            want = float(torch.log_softmax(logits, dim=-1)[token])
            assert got[k] == pytest.approx(want, abs=1e-5)


class _Scorer:
    vocab_size = 512

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        return [[-1.0 + self.shift] * len(c) for c in completions]


def _groups() -> list[list[Completion]]:
    return [
        [
            Completion(0, 0, [1, 2], [5, 6], 0, "worker@0", 0.5, [-1.0, -1.0], "length"),
            Completion(0, 1, [1, 2], [7], 0, "worker@1", 0.0, [-1.0], "length", migrated=True),
        ]
    ]


def test_the_trainer_fails_loudly_when_the_engine_disagrees() -> None:
    trainer = object.__new__(Trainer)
    trainer._learner = _Scorer(0.0)  # type: ignore[assignment]
    report = trainer.check_boundary(3, _groups())
    assert (report.terminal, report.cancelled, report.tokens) == (1, 1, 3)
    trainer._learner = _Scorer(0.05)  # type: ignore[assignment]
    with pytest.raises(TrainerError, match="step 3: the engine's logprobs do not match"):
        trainer.check_boundary(3, _groups())


async def _numpy_engine_completions(
    model_dir: Path, prompts: list[list[int]]
) -> list[tuple[list[int], list[float]]]:
    """Sampled completions (temperature 1, top-k, seeded) and their logprobs, from the
    worker's numpy engine, batched as the worker serves them."""
    from dynamod.workers.cpu.numpy_engine import NumpyEngine
    from dynamod.workers.weights import load_checkpoint

    engine = NumpyEngine(model_dir, load_checkpoint(model_dir, "numpy"), 4, 64, print)
    await engine.start()

    async def one(seed: int, tokens: list[int]) -> tuple[list[int], list[float]]:
        request = {
            "token_ids": tokens,
            "sampling_options": {"temperature": 1.0, "top_k": 50, "seed": seed},
            "stop_conditions": {"max_tokens": 10, "ignore_eos": True},
        }
        chunks = [c async for c in engine.generate(request)]
        return (
            [t for c in chunks for t in c["token_ids"]],
            [lp for c in chunks for lp in c["log_probs"]],
        )

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.close()


def test_the_numpy_engines_logprobs_pass_the_trainers_check(tmp_path: Path) -> None:
    """The worker (numpy) and the trainer (torch `llama.py`) agree within the boundary's
    tolerance on the same weights; under other weights the same check fails."""
    from dynamod.trainer.checkpoints import save_step
    from dynamod.trainer.scoring import load_policy
    from dynamod.workers.model import ensure_model
    from dynamod.workers.weights import load_checkpoint

    model_dir = ensure_model(tmp_path / "tiny")
    prompts = [[1, 30, 31, 32, 33, 34], [1, 40], [1, 50, 51, 52, 53, 54, 55, 56, 57]]
    served = asyncio.run(_numpy_engine_completions(model_dir, prompts))
    model, pad_id = load_policy(model_dir)
    recomputed = completion_logprobs(model, prompts, [c for c, _ in served], pad_id)
    report = check(
        [Scored(c, lps, r, cancelled=False) for (c, lps), r in zip(served, recomputed, strict=True)]
    )
    assert report.ok and report.tokens == 30, report.mismatches
    other = save_step(
        tmp_path / "ckpt",
        1,
        {n: t * 1.5 for n, t in load_checkpoint(model_dir).tensors.items()},
    )
    stale, _ = load_policy(model_dir, other)
    wrong = completion_logprobs(stale, prompts, [c for c, _ in served], pad_id)
    assert not check(
        [Scored(c, lps, r, cancelled=False) for (c, lps), r in zip(served, wrong, strict=True)]
    ).ok
