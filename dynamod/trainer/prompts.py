"""The trainer's built-in prompts and which ones a step uses."""

from __future__ import annotations

import random

PROMPTS = (
    "Tell me a story about a small robot.",
    "What is two plus two?",
    "The rollout worker samples tokens from",
    "Every shard must serve the newest policy",
    "Hello world! The quick brown fox",
    "The trainer computes advantages and",
    "When a worker dies the supervisor",
    "Reinforcement learning from human feedback uses",
)


def prompts_for_step(step: int, count: int, pool: tuple[str, ...] = PROMPTS) -> list[str]:
    """`count` distinct prompts (repeating the pool if it is smaller), the same for a given
    step on every run, so a resumed trainer replays a step's prompts exactly."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    order = list(pool)
    random.Random(step).shuffle(order)
    return [order[i % len(order)] for i in range(count)]
