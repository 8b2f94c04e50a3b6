"""Boundary 1: the token ids and logprobs the trainer consumes are the engine's.

For every completion the engine's logprobs must be one per completion token, in order,
and each within `LOGPROB_TOLERANCE` of the trainer's own recomputation under the same
weights. Completions are counted by how they ended: *terminal* (the engine finished
them: stop or length, on the shard the router picked) and *cancelled* (aborted by a
pause, or migrated to another shard midway); both are checked, and counted apart.
Pure: the loop hands in what came back and what it recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# float32, token by token with a KV cache (engine) vs one padded pass (trainer): they
# differ by ~1e-6; a weight update moves them by ~1e-2 and more.
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Scored:
    """One completion as the engine returned it, with what the trainer recomputed."""

    token_ids: Sequence[int]
    engine_logprobs: Sequence[float] | None
    recomputed: Sequence[float]
    cancelled: bool  # aborted or migrated


@dataclass
class BoundaryReport:
    terminal: int = 0
    cancelled: int = 0
    tokens: int = 0
    max_abs_diff: float = 0.0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def check(completions: Sequence[Scored], tolerance: float = LOGPROB_TOLERANCE) -> BoundaryReport:
    """Compare each completion's engine logprobs with the recomputed ones."""
    report = BoundaryReport()
    for i, c in enumerate(completions):
        if c.cancelled:
            report.cancelled += 1
        else:
            report.terminal += 1
        kind = "cancelled" if c.cancelled else "terminal"
        if c.engine_logprobs is None:
            if c.token_ids:
                report.mismatches.append(f"completion {i} ({kind}): no logprobs returned")
            continue
        if len(c.engine_logprobs) != len(c.token_ids):
            report.mismatches.append(
                f"completion {i} ({kind}): {len(c.engine_logprobs)} logprobs for "
                f"{len(c.token_ids)} tokens"
            )
            continue
        report.tokens += len(c.token_ids)
        for position, (got, want) in enumerate(
            zip(c.engine_logprobs, c.recomputed, strict=True)
        ):
            diff = abs(float(got) - float(want))
            report.max_abs_diff = max(report.max_abs_diff, diff)
            if diff > tolerance:
                report.mismatches.append(
                    f"completion {i} ({kind}) token {position} (id {c.token_ids[position]}): "
                    f"engine {got:.6f}, trainer {want:.6f}, |diff| {diff:.2e} > {tolerance:.0e}"
                )
                break
    return report
