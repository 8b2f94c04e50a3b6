"""GRPO arithmetic: rewards, group-normalised advantages and the policy-gradient loss.

Pure functions (no I/O, no model): the loop feeds them token ids and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any


def fold_into_vocab(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Map engine token ids into the policy's vocabulary (`id mod vocab_size`).

    Dynamo's mocker samples ids outside the tiny model's vocabulary ([1000, 2000) against
    512 entries), so the policy could not score them as they are. For an engine that
    samples from the policy itself every id is already in range and this is the identity.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return [int(t) % vocab_size for t in token_ids]


def word_start_ids(vocab: Mapping[str, int], marker: str = "\u0120") -> frozenset[int]:
    """Ids of byte-level BPE tokens that begin a word (their text starts with the space
    marker `Ġ`): the target set of the trainer's reward, "start new words"."""
    return frozenset(i for token, i in vocab.items() if token.startswith(marker))


def fraction_reward(token_ids: Sequence[int], target: Collection[int]) -> float:
    """Share of the completion's tokens that lie in `target`; 0.0 for an empty completion."""
    if not token_ids:
        return 0.0
    return sum(1 for t in token_ids if t in target) / len(token_ids)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantages of one group of completions for the same prompt: (r - mean) / std.

    A group whose rewards are all equal carries no signal: every advantage is 0.0
    (not a division by a vanishing std).
    """
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


def token_logprobs(logits: Any, input_ids: Any) -> Any:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, shape [batch, length - 1]."""
    import torch

    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def completion_mask(prompt_lens: Sequence[int], completion_lens: Sequence[int], length: int) -> Any:
    """1.0 where `token_logprobs`' column predicts a completion token, else 0.0.

    Column t predicts token t + 1, so a completion occupying tokens [p, p + c) is
    columns [p - 1, p + c - 1).
    """
    import torch

    mask = torch.zeros(len(prompt_lens), length - 1)
    for row, (p, c) in enumerate(zip(prompt_lens, completion_lens, strict=True)):
        if p < 1:
            raise ValueError(f"row {row}: a prompt needs at least one token")
        mask[row, p - 1 : p - 1 + c] = 1.0
    return mask


def policy_loss(logprobs: Any, mask: Any, advantages: Any) -> Any:
    """-(advantage * mean completion log-prob), averaged over the batch.

    Minimising it raises the probability of completions with positive advantage and
    lowers it for negative ones; rows with no completion tokens contribute 0.
    """
    per_row = (logprobs * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return -(advantages * per_row).mean()
