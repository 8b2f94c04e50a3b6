"""Sampling for the numpy engine: request options -> parameters, logits -> token + logprobs.

Pure functions over 1-D numpy float32 logits (no model, no I/O, no torch); a seeded
`numpy.random.Generator` (`generator_for`) fixes the draws. The logprob reported for a sampled
token is the model's own: `log_softmax` of the raw logits, before temperature, top-k or
top-p reshape the distribution (vLLM's default, `raw_logprobs`), so a trainer scoring the
completion under the same weights computes the same number whatever the sampling options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[np.float32]

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop rule."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # end the completion, returned last
    logprobs: int | None = None  # top-k alternatives per position; None: none asked

    @classmethod
    def from_request(cls, request: Mapping[str, Any]) -> SamplingParams:
        """From a Dynamo `PreprocessedRequest` (`sampling_options`, `stop_conditions`,
        `output_options`, `eos_token_ids`); absent or null fields take the defaults."""
        sampling = request.get("sampling_options") or {}
        stop = request.get("stop_conditions") or {}
        output = request.get("output_options") or {}
        stops = set(stop.get("stop_token_ids_hidden") or [])
        if not stop.get("ignore_eos"):
            stops.update(request.get("eos_token_ids") or [])
        temperature = sampling.get("temperature")
        top_p = sampling.get("top_p")
        top_k = sampling.get("top_k")
        seed = sampling.get("seed")
        max_tokens = stop.get("max_tokens")
        logprobs = output.get("logprobs")
        return cls(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None or int(top_k) < 0 else int(top_k),
            seed=None if seed is None else int(seed),
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens),
            min_tokens=int(stop.get("min_tokens") or 0),
            stop_token_ids=frozenset(int(t) for t in stops),
            logprobs=None if logprobs is None or int(logprobs) < 0 else int(logprobs),
        )


def generator_for(seed: int | None) -> np.random.Generator:
    """The draws of one request: fixed by its seed, fresh entropy without one."""
    return np.random.default_rng(seed)


def raw_logprobs(logits: Logits) -> Logits:
    """log p over the vocabulary (last axis) of `logits`, in float32."""
    logits = np.asarray(logits, dtype=np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    result: Logits = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def sampling_distribution(logits: Logits, params: SamplingParams) -> Logits:
    """Probabilities to sample from after temperature, top-k and top-p (1-D logits)."""
    scaled = np.asarray(logits, dtype=np.float32) / np.float32(params.temperature)
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, scaled.size - params.top_k)[scaled.size - params.top_k]
        scaled = np.where(scaled < kth, np.float32(-np.inf), scaled)
    probs: Logits = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        sorted_probs = np.where(before >= params.top_p, np.float32(0.0), sorted_probs)
        probs = np.zeros_like(probs)
        probs[order] = sorted_probs
        probs /= probs.sum()
    return probs


def sample(
    logits: Logits, params: SamplingParams, generator: np.random.Generator,
    banned: Sequence[int] = (),
) -> int:
    """One token id from 1-D `logits`: greedy at temperature 0, else a draw from
    `sampling_distribution` with `generator` (so a seed fixes the draw)."""
    if banned:
        logits = np.array(logits, dtype=np.float32)
        logits[list(banned)] = -np.inf
    if params.temperature <= 0.0:
        return int(np.argmax(logits))
    probs = sampling_distribution(logits, params).astype(np.float64)
    cumulative = np.cumsum(probs)
    # Inverse CDF: side="right" never lands on a zero-probability token.
    token = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    return min(token, int(np.flatnonzero(probs)[-1]))


def top_entries(logprobs: Logits, chosen: int, count: int) -> list[dict[str, Any]]:
    """The chosen token and the `count` most likely ones, as Dynamo's `top_logprobs`
    entries (`rank` 1 is the most likely; the chosen token carries its own rank)."""
    entries: list[dict[str, Any]] = []
    chosen_rank = int((logprobs > logprobs[chosen]).sum()) + 1
    entries.append({"rank": chosen_rank, "token_id": chosen, "logprob": float(logprobs[chosen])})
    if count > 0:
        ids = np.argsort(-logprobs, kind="stable")[:count]
        for rank, token in enumerate(ids.tolist()):
            if int(token) != chosen:
                entries.append(
                    {"rank": rank + 1, "token_id": int(token), "logprob": float(logprobs[token])}
                )
    return entries
