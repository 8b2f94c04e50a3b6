"""Sampling and logprobs of the numpy engine (pure functions over small arrays)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynamod.workers.cpu.sampling import (
    SamplingParams,
    generator_for,
    raw_logprobs,
    sample,
    sampling_distribution,
    top_entries,
)

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, -3.0], dtype=np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draws(params: SamplingParams, seed: int, n: int = 200) -> list[int]:
    generator = generator_for(seed)
    return [sample(LOGITS, params, generator) for _ in range(n)]


def test_request_options_map_onto_parameters() -> None:
    params = SamplingParams.from_request(
        {
            "sampling_options": {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 7},
            "stop_conditions": {"max_tokens": 5, "min_tokens": 2, "stop_token_ids_hidden": [9]},
            "output_options": {"logprobs": 2},
            "eos_token_ids": [2],
        }
    )
    assert params == SamplingParams(0.5, 0.9, 3, 7, 5, 2, frozenset({2, 9}), 2)


def test_absent_options_take_defaults_and_ignore_eos_drops_the_eos_stop() -> None:
    assert SamplingParams.from_request({}) == SamplingParams()
    params = SamplingParams.from_request(
        {"stop_conditions": {"ignore_eos": True, "max_tokens": None}, "eos_token_ids": [2]}
    )
    assert params.stop_token_ids == frozenset() and params.max_tokens == 16


def test_temperature_zero_is_greedy() -> None:
    assert set(draws(SamplingParams(temperature=0.0), seed=1, n=20)) == {0}


def test_the_same_seed_gives_the_same_draws_and_another_seed_other_draws() -> None:
    params = SamplingParams(temperature=1.0)
    assert draws(params, seed=3) == draws(params, seed=3)
    assert draws(params, seed=3) != draws(params, seed=4)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    probs = softmax(LOGITS)  # ~[0.61, 0.22, 0.14, 0.03, 0.004]
    kept = sampling_distribution(LOGITS, SamplingParams(top_p=0.7))
    assert kept[2:].sum() == 0 and kept[:2].sum() == pytest.approx(1.0)
    assert kept[0] / kept[1] == pytest.approx(float(probs[0] / probs[1]))
    assert set(draws(SamplingParams(top_p=0.7), seed=5)) == {0, 1}
    # top_p below the first token's mass still keeps that token.
    assert set(draws(SamplingParams(top_p=0.1), seed=5, n=30)) == {0}


def test_top_k_and_temperature_reshape_the_distribution() -> None:
    assert set(draws(SamplingParams(top_k=2), seed=6)) <= {0, 1}
    hot = sampling_distribution(LOGITS, SamplingParams(temperature=2.0))
    cold = sampling_distribution(LOGITS, SamplingParams(temperature=0.5))
    assert hot[0] < softmax(LOGITS)[0] < cold[0]


def test_banned_tokens_are_never_sampled() -> None:
    generator = generator_for(0)
    greedy = SamplingParams(temperature=0.0)
    picks = {sample(LOGITS, greedy, generator, banned=[0]) for _ in range(5)}
    assert picks == {1}


def test_reported_logprobs_are_the_raw_distributions_whatever_the_sampling() -> None:
    logprobs = raw_logprobs(LOGITS)
    assert float(np.exp(logprobs).sum()) == pytest.approx(1.0)
    expected = float(LOGITS[1]) - math.log(float(np.exp(LOGITS).sum()))
    assert float(logprobs[1]) == pytest.approx(expected, abs=1e-6)


def test_top_entries_carry_the_chosen_token_with_its_rank() -> None:
    logprobs = raw_logprobs(LOGITS)
    entries = top_entries(logprobs, chosen=2, count=2)
    assert entries[0] == {"rank": 3, "token_id": 2, "logprob": float(logprobs[2])}
    assert [(e["rank"], e["token_id"]) for e in entries[1:]] == [(1, 0), (2, 1)]
    assert [e["token_id"] for e in top_entries(logprobs, chosen=0, count=2)] == [0, 1]


def test_draws_follow_the_sampling_distribution() -> None:
    """4000 seeded draws: each token's share within 0.03 of its probability (top-k 3 at
    temperature 0.8), and never a token the distribution gives nothing."""
    params = SamplingParams(temperature=0.8, top_k=3)
    expected = sampling_distribution(LOGITS, params)
    counts = np.bincount(draws(params, seed=11, n=4000), minlength=LOGITS.size)
    assert np.abs(counts / 4000 - expected).max() < 0.03
    assert counts[expected == 0].sum() == 0 and (counts[expected > 0] > 0).all()
