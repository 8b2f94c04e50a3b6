"""The reward curve: mean reward per policy version, read from the history, as a PNG.

Drawn with matplotlib (the `stack` extra) on the Agg backend, beside the history file
(`history.jsonl` -> `reward.png`): one point per rollout round, training rounds and the
final evaluation round marked apart.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dynamod.trainer.history import read_history


def mean_rewards(records: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(phase, version served) -> mean reward of the successful requests."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        if r["ok"] and r["reward"] is not None and isinstance(r["served_version"], int):
            sums[(r["phase"], r["served_version"])].append(float(r["reward"]))
    return {key: sum(v) / len(v) for key, v in sorted(sums.items())}


def curve_path(history: Path) -> Path:
    return history.with_name("reward.png")


def write_reward_curve(history: Path, out: Path | None = None) -> Path:
    """Plot the history's reward per version into `out` (default: beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or curve_path(history)
    means = mean_rewards(read_history(history))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for phase, style in (("train", "o-"), ("eval", "s")):
        points = sorted((v, m) for (p, v), m in means.items() if p == phase)
        if points:
            ax.plot([v for v, _ in points], [m for _, m in points], style, label=phase)
    ax.set_xlabel("policy version (step)")
    ax.set_ylabel("mean reward")
    ax.set_title("CPU GRPO trainer: share of word-start tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out
