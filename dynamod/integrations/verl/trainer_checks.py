"""Checks over one run of verl's own trainer, for scripts/validate-cpu.sh.

`python -m dynamod.integrations.verl.trainer_checks CHECK --log FILE --state-dir DIR
[--steps N] [--label L]` reads main_ppo's console output (`--log`) and the backend's
update log, prints one `PASS|FAIL <check>: <detail>` line and exits 0 or 1:

* `smoke`: the validation-only run (`trainer.val_only=True`) reported validation
  metrics through the stack.
* `iteration`: N training steps, each with rollout, reward/advantage, an actor update
  and a weight update; the updates logged verl's steps 0..N (the start and one per
  step), each a new digest.
* `alignment` (boundary 1): the completion token ids and logprobs verl consumed line up
  with the engine's: verl recomputes each response token's logprob with its actor at the
  same weights and compares it with the rollout's (`training/rollout_probs_diff_*`); a
  token out of place or out of order shows as a large difference. Responses aborted
  (cancelled) are counted apart from terminal ones (`response/aborted_ratio`).
* `summary --label L`: the run's useful output for the routing comparison (boundary 3):
  mean reward, response tokens per second of generation, as one JSON line.

The judging functions are pure and unit-tested; `main` only reads the files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# verl's console logger: "step:N - key:value - key:value ..."
_STEP_LINE = re.compile(r"\bstep:(\d+) - (.*)$")
_NUMBER = re.compile(r"^(?:np\.float64\()?([-+0-9.eE]+|nan|inf)\)?$")
ALIGNMENT_MAX_DIFF = 1e-3  # probability, per token: far below any misplaced token's
VALIDATION_MARK = "Initial validation metrics:"
# pprint's wrap of a long string: "...'" newline, Ray's "(Actor pid=N)" prefix, "'..."
_ANSI = r"(?:\x1b\[[0-9;]*m)?"
_PPRINT_JOIN = re.compile(rf"['\"]\s*\n{_ANSI}(?:\(\w+ pid=\d+[^)]*\))?{_ANSI}\s*['\"]")
_VAL_METRIC = re.compile(r"'(val-(?:core|aux)/[^']+)': (?:np\.float64\()?([-+0-9.eE]+)")


def parse_steps(text: str) -> list[dict[str, float]]:
    """Each training step's metrics, in order (step number under "step")."""
    steps: list[dict[str, float]] = []
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if match is None:
            continue
        metrics: dict[str, float] = {"step": float(match.group(1))}
        for part in match.group(2).split(" - "):
            key, _, value = part.strip().partition(":")
            number = _NUMBER.match(value.strip())
            if key and number:
                metrics[key] = float(number.group(1))
        steps.append(metrics)
    return steps


def parse_validation(text: str) -> dict[str, float] | None:
    """The metrics verl printed after its validation pass, if it printed them (pprint may
    wrap the line; Ray prefixes each piece, so keys are found by pattern)."""
    at = text.find(VALIDATION_MARK)
    if at < 0:
        return None
    found = _VAL_METRIC.findall(_PPRINT_JOIN.sub("", text[at:]))
    return {key: float(value) for key, value in found}


def judge_smoke(validation: Mapping[str, float] | None) -> tuple[bool, str]:
    if validation is None:
        return False, "verl printed no validation metrics (did the val_only run reach the stack?)"
    rewards = {k: v for k, v in validation.items()
               if any(part in k for part in ("/reward/", "/acc/", "score"))}
    if not rewards:
        return False, f"validation metrics without a reward: {sorted(validation)[:5]}"
    key, value = sorted(rewards.items(), key=lambda kv: not kv[0].startswith("val-core"))[0]
    return True, f"validation through the stack: {key}={value:.4g}"


_STEP_PARTS = {
    "rollout": "timing_s/gen",
    "reward/advantage": "critic/advantages/mean",
    "actor update": "timing_s/update_actor",
    "weight update": "timing_s/update_weights",
}


def judge_iteration(steps: Sequence[Mapping[str, float]], updates: Sequence[Mapping[str, Any]],
                    wanted: int) -> tuple[bool, str]:
    done = [int(s["step"]) for s in steps]
    if done != list(range(1, wanted + 1)):
        return False, f"verl logged steps {done}, wanted 1..{wanted}"
    for metrics in steps:
        missing = [part for part, key in _STEP_PARTS.items() if key not in metrics]
        if missing:
            return False, f"step {int(metrics['step'])} has no {', '.join(missing)}"
    run = updates[-(wanted + 1):] if len(updates) > wanted else list(updates)
    verl_steps = [u.get("verl_step") for u in run]
    if verl_steps != list(range(wanted + 1)):
        return False, f"weight updates logged verl steps {verl_steps}, wanted 0..{wanted}"
    digests = [u.get("digest") for u in run]
    versions = [u.get("step") for u in run]
    parts = f"{wanted} steps (rollout, reward/advantage, actor update, weight update)"
    if not any(digests):
        # The engine reports no digest of what it loaded (dynamo.vllm's
        # update_weights_from_disk and get_weight_version carry none): every shard must
        # still have acknowledged every update, each loading a checkpoint of its own, and
        # boundary-1 (verl's recompute of every token's logprob at the same weights) is
        # what shows the engine holds them.
        unacked = {u.get("verl_step"): u.get("errors") or u.get("stale")
                   for u in run if u.get("errors") or u.get("stale")
                   or set(u.get("acks") or {}) != set(u.get("shards") or ())}  # fmt: skip
        if unacked:
            return False, f"updates not acknowledged by every shard (verl step: why): {unacked}"
        checkpoints = [u.get("checkpoint") for u in run]
        if not all(checkpoints) or len(set(checkpoints)) != len(checkpoints):
            return False, f"the updates did not each load a checkpoint of their own: {checkpoints}"
        return True, (f"{parts}; versions {versions}, {len(run)} checkpoints; no digests: the "
                      "engine reports none (boundary-1's logprobs judge the weights)")
    if not all(digests) or len(set(digests)) != len(digests):
        return False, f"the updates' digests do not all differ: {digests}"
    return True, f"{parts}; versions {versions}, {len(set(digests))} digests"


def judge_alignment(steps: Sequence[Mapping[str, float]]) -> tuple[bool, str]:
    if not steps:
        return False, "no training step to judge"
    worst = 0.0
    aborted = terminal = 0.0
    for metrics in steps:
        where = f"step {int(metrics['step'])}"
        if metrics.get("training/rollout_probs_diff_valid") != 1.0:
            return False, (f"{where}: verl kept no rollout logprobs to compare "
                           "(actor_rollout_ref.rollout.calculate_log_probs)")
        diff = metrics.get("training/rollout_probs_diff_max", float("inf"))
        if not diff <= ALIGNMENT_MAX_DIFF:
            return False, (f"{where}: rollout vs recomputed token probability differs by "
                           f"{diff:.3g} (> {ALIGNMENT_MAX_DIFF:g}): tokens out of place")
        worst = max(worst, diff)
        ratio = metrics.get("response/aborted_ratio", 0.0)
        aborted += ratio
        terminal += 1.0 - ratio
    count = len(steps)
    return True, (f"{count} steps: token probabilities match verl's recompute "
                  f"(max diff {worst:.2g}); responses terminal {terminal / count:.0%}, "
                  f"cancelled {aborted / count:.0%}")


def summary(steps: Sequence[Mapping[str, float]], label: str) -> dict[str, Any]:
    """Reward and generation throughput of a run, for the routing comparison. The first
    step's generation includes the agent loop's start (cold); tokens/s is over the rest."""
    rewards = [s["critic/score/mean"] for s in steps if "critic/score/mean" in s]
    warm = steps[1:] if len(steps) > 1 else steps
    per_token = [s["timing_per_token_ms/gen"] for s in warm if "timing_per_token_ms/gen" in s]
    return {
        "label": label,
        "steps": len(steps),
        "reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "first_gen_s": round(steps[0].get("timing_s/gen", 0.0), 2) if steps else None,
        "gen_tokens_per_s": round(1000 * len(per_token) / sum(per_token), 1)
        if per_token and sum(per_token) > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamod.integrations.verl.trainer_checks")
    parser.add_argument("check", choices=["smoke", "iteration", "alignment", "summary"])
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    text = args.log.read_text(errors="replace") if args.log.exists() else ""
    if args.check == "smoke":
        ok, detail = judge_smoke(parse_validation(text))
    elif args.check == "iteration":
        from dynamod.integrations.verl.updates import read_updates

        if args.state_dir is None:
            parser.error("iteration needs --state-dir")
        ok, detail = judge_iteration(parse_steps(text), read_updates(args.state_dir), args.steps)
    elif args.check == "alignment":
        ok, detail = judge_alignment(parse_steps(text))
    else:
        row = summary(parse_steps(text), args.label)
        ok, detail = row["steps"] > 0, json.dumps(row)
    print(f"{'PASS' if ok else 'FAIL'} {args.check}{' ' + args.label if args.label else ''}: "
          f"{detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
