"""Scoring completions under a set of weights: the logprob of each sampled token.

The trainer's side of boundary 1: the same number the engine reports (`log_softmax` of
the raw logits, see `dynamod.workers.cpu.sampling`), computed in one padded full pass
instead of token by token with a KV cache. The two agree to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamod.trainer import grpo
from dynamod.workers.weights import load_checkpoint


def padded_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """(input_ids, attention_mask) for right-padded `rows`."""
    import torch

    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        attention[i, : len(row)] = 1
    return input_ids, attention


def completion_logprobs(
    model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> list[list[float]]:
    """log p(completion token | prompt and the completion before it), per completion."""
    import torch

    rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    input_ids, attention = padded_rows(rows, pad_id)
    with torch.no_grad():
        logits, _ = model(input_ids, attention_mask=attention)
        logprobs = grpo.token_logprobs(logits, input_ids)
    out: list[list[float]] = []
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out.append([float(x) for x in logprobs[row, len(p) - 1 : len(p) - 1 + len(c)]])
    return out


def load_policy(model_dir: Path, checkpoint: Path | None = None) -> tuple[Any, int]:
    """(the worker's Llama in eval mode, pad id) from the model directory's config, at the
    weights of `checkpoint` (default: the model directory's own)."""
    from dynamod.workers.cpu.llama import Llama

    model = Llama.from_dir(model_dir, load_checkpoint(checkpoint or model_dir).tensors)
    return model, int(model.config.pad_token_id or 0)
