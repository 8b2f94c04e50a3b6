"""The toy task's reward, for verl's `reward.custom_reward_function` (run.py sets it).

verl's GSM8K rule scores 1 only for the right number after `####`, which a tiny random
model never writes: every response scores 0, GRPO's group advantages are all 0 and the
actor update changes nothing. This reward is graded: 1 for the right answer anywhere in
the response, else the share of its characters that are digits, so sampled responses
in a group differ and each update moves the weights.
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: Any = None, **kwargs: Any) -> float:
    if ground_truth and ground_truth in solution_str:
        return 1.0
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
