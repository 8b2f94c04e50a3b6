"""Which weights does a shard really serve? A checker that reads its outputs, not its report.

`check_shard_outputs` sends fixed prompts under a fixed seed to one shard (pinned through
the frontend with `nvext.backend_instance_id`), then scores the tokens it returned under
the weights it should hold. A shard at those weights returns logprobs within
`LOGPROB_TOLERANCE` of the recomputation; a shard at other weights (one version behind,
say) differs far beyond it, whatever version and digest it reports about itself.
Synchronous (urllib), so a runbook or a test can call it as it is.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError
from dynamod.trainer.boundary import LOGPROB_TOLERANCE
from dynamod.trainer.scoring import completion_logprobs, load_policy

DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = ((1, 40, 41, 42), (1, 100, 7, 300, 12), (1, 5))


class ShardCheckError(DynamodError):
    """The shard could not be asked, or answered from another instance."""


@dataclass(frozen=True)
class ShardSample:
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]
    engine_data: dict[str, Any]


@dataclass(frozen=True)
class ShardOutputCheck:
    instance_id: int
    max_abs_diff: float
    tolerance: float
    tokens: int
    reported_digest: str | None  # what the shard says it holds (not trusted, only shown)

    @property
    def matches(self) -> bool:
        """The shard's outputs are those of the expected weights."""
        return self.max_abs_diff <= self.tolerance

    def __str__(self) -> str:
        verdict = "serves the expected weights" if self.matches else "serves OTHER weights"
        return (
            f"instance {self.instance_id} {verdict}: max |logprob diff| {self.max_abs_diff:.2e} "
            f"over {self.tokens} tokens (tolerance {self.tolerance:.0e}; it reports digest "
            f"{(self.reported_digest or '?')[:12]})"
        )


def sample_shard(
    frontend: str,
    model: str,
    instance_id: int,
    prompt: Sequence[int],
    seed: int,
    max_tokens: int,
    timeout: float = 30.0,
) -> ShardSample:
    """One completion of `prompt` from the shard `instance_id`, with its logprobs."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 0,
        "ignore_eos": True,
        "nvext": {
            "backend_instance_id": instance_id,
            "extra_fields": ["completion_token_ids", "engine_data"],
        },
    }
    request = urllib.request.Request(
        f"{frontend}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise ShardCheckError(f"{frontend}: completion for instance {instance_id}: {exc}") from exc
    nvext = reply.get("nvext") or {}
    engine = nvext.get("engine_data") or {}
    if engine.get("instance_id") != instance_id:
        raise ShardCheckError(
            f"asked instance {instance_id}, answered by {engine.get('instance_id')}: is "
            "the instance id right (liveness_probe's instance_id)?"
        )
    logprobs = (reply["choices"][0].get("logprobs") or {}).get("token_logprobs") or []
    return ShardSample(
        list(prompt),
        [int(t) for t in nvext.get("completion_token_ids") or []],
        [float(x) for x in logprobs],
        engine,
    )


def check_shard_outputs(
    frontend: str,
    model: str,
    instance_id: int,
    model_dir: Path,
    checkpoint: Path | None = None,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    seed: int = 1234,
    max_tokens: int = 8,
    tolerance: float = LOGPROB_TOLERANCE,
) -> ShardOutputCheck:
    """Do the shard's outputs come from `checkpoint` (default: the model directory's
    weights)? Scores what it returns for `prompts` under `seed` against those weights."""
    samples = [sample_shard(frontend, model, instance_id, p, seed, max_tokens) for p in prompts]
    policy, pad_id = load_policy(model_dir, checkpoint)
    expected = completion_logprobs(
        policy, [s.prompt for s in samples], [s.token_ids for s in samples], pad_id
    )
    worst = 0.0
    tokens = 0
    for sample, want in zip(samples, expected, strict=True):
        if len(sample.logprobs) != len(sample.token_ids):
            worst = float("inf")  # no logprobs, or misaligned: cannot be these weights' output
            continue
        tokens += len(want)
        for got, ref in zip(sample.logprobs, want, strict=True):
            worst = max(worst, abs(got - ref))
    digest = samples[-1].engine_data.get("weight_digest") if samples else None
    return ShardOutputCheck(instance_id, worst, tolerance, tokens, digest)
