"""Sampling for the torch engine: request options -> parameters, logits -> token + logprobs.

Pure functions over torch tensors (no model, no I/O). The logprob reported for a sampled
token is the model's own: `log_softmax` of the raw logits, before temperature, top-k or
top-p reshape the distribution (vLLM's default, `raw_logprobs`), so a trainer scoring the
completion under the same weights computes the same number whatever the sampling options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    stop_token_ids: frozenset[int] = frozenset()  # end the completion; not returned
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


def raw_logprobs(logits: Any) -> Any:
    """log p over the vocabulary for each row of `logits` (float32)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1)


def sampling_distribution(logits: Any, params: SamplingParams) -> Any:
    """Probabilities to sample from after temperature, top-k and top-p (1-D logits)."""
    import torch

    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: Any, params: SamplingParams, generator: Any, banned: Sequence[int] = ()) -> int:
    """One token id from 1-D `logits`: greedy at temperature 0, else a draw from
    `sampling_distribution` with `generator` (so a seed fixes the draw)."""
    import torch

    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = sampling_distribution(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def top_entries(logprobs: Any, chosen: int, count: int) -> list[dict[str, Any]]:
    """The chosen token and the `count` most likely ones, as Dynamo's `top_logprobs`
    entries (`rank` 1 is the most likely; the chosen token carries its own rank)."""
    import torch

    entries: list[dict[str, Any]] = []
    chosen_rank = int((logprobs > logprobs[chosen]).sum().item()) + 1
    entries.append({"rank": chosen_rank, "token_id": chosen, "logprob": float(logprobs[chosen])})
    if count > 0:
        values, ids = torch.topk(logprobs, count)
        for rank, (value, token) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            if int(token) != chosen:
                entries.append({"rank": rank + 1, "token_id": int(token), "logprob": float(value)})
    return entries
