"""The validation's judges over verl's console output (pure): each passes on a good run
and fails on the fault it exists to catch."""

from __future__ import annotations

from typing import Any

from dynamod.integrations.verl.trainer_checks import (
    judge_alignment,
    judge_iteration,
    judge_smoke,
    parse_steps,
    parse_validation,
    summary,
)

GOOD = (
    "(TaskRunner pid=1) step:1 - critic/score/mean:0.04 - critic/advantages/mean:np.float64(0.0)"
    " - timing_s/gen:3.5 - timing_s/update_actor:2.3 - timing_s/update_weights:0.2"
    " - training/rollout_probs_diff_valid:1 - training/rollout_probs_diff_max:4.3e-05"
    " - response/aborted_ratio:0.0 - timing_per_token_ms/gen:12.0 - timing_s/step:326.7\n"
    "(TaskRunner pid=1) step:2 - critic/score/mean:0.0 - critic/advantages/mean:0.0"
    " - timing_s/gen:0.4 - timing_s/update_actor:0.3 - timing_s/update_weights:0.1"
    " - training/rollout_probs_diff_valid:1 - training/rollout_probs_diff_max:5.7e-05"
    " - response/aborted_ratio:0.25 - timing_per_token_ms/gen:10.0\n"
)


def updates(*pairs: tuple[int, int], digests: list[str] | None = None) -> list[dict[str, Any]]:
    digests = digests or [f"d{v}" for _, v in pairs]
    return [{"verl_step": s, "step": v, "digest": d}
            for (s, v), d in zip(pairs, digests, strict=True)]


def test_parse_steps_reads_verl_console_metrics() -> None:
    steps = parse_steps(GOOD)
    assert [s["step"] for s in steps] == [1.0, 2.0]
    assert steps[0]["critic/advantages/mean"] == 0.0 and steps[0]["timing_s/step"] == 326.7


def test_iteration_passes_and_fails() -> None:
    steps = parse_steps(GOOD)
    ok, detail = judge_iteration(steps, updates((0, 0), (1, 1), (2, 2)), 2)
    assert ok, detail
    ok, detail = judge_iteration(steps, updates((0, 0), (1, 1), (2, 2), digests=["a", "b", "b"]), 2)
    assert not ok and "digests" in detail
    ok, detail = judge_iteration(steps[:1], updates((0, 0), (1, 1)), 2)
    assert not ok and "steps [1]" in detail
    # an engine that reports no digest (dynamo.vllm's disk path): a checkpoint per update
    blind = [{**u, "digest": None, "checkpoint": f"/ckpt/{u['verl_step']}",
              "shards": ["w@0"], "acks": {"w@0": None}}
             for u in updates((0, 0), (1, 1), (2, 2))]  # fmt: skip
    ok, detail = judge_iteration(steps, blind, 2)
    assert ok and "no digests" in detail, detail
    # no digest because the update failed on the shard (it was replayed from disk after)
    failed = [{**u, "acks": {}, "errors": {"w@0": "bucket: AttributeError"}, "stale": ["w@0"]}
              for u in blind]  # fmt: skip
    ok, detail = judge_iteration(steps, failed, 2)
    assert not ok and "not acknowledged" in detail and "AttributeError" in detail, detail
    blind[2]["checkpoint"] = blind[1]["checkpoint"]
    ok, detail = judge_iteration(steps, blind, 2)
    assert not ok and "checkpoint of their own" in detail, detail
    blind[2] = {**blind[2], "checkpoint": "/ckpt/2", "digest": "d2"}  # some digests, not all
    ok, detail = judge_iteration(steps, blind, 2)
    assert not ok and "digests" in detail, detail
    no_update = [{k: v for k, v in s.items() if k != "timing_s/update_weights"} for s in steps]
    ok, detail = judge_iteration(no_update, updates((0, 0), (1, 1), (2, 2)), 2)
    assert not ok and "weight update" in detail


def test_alignment_passes_and_counts_cancelled_apart() -> None:
    ok, detail = judge_alignment(parse_steps(GOOD))
    assert ok and "terminal 88%" in detail and "cancelled 12%" in detail, detail


def test_alignment_fails_on_a_misplaced_token() -> None:
    bad = GOOD.replace("rollout_probs_diff_max:5.7e-05", "rollout_probs_diff_max:0.62")
    ok, detail = judge_alignment(parse_steps(bad))
    assert not ok and "step 2" in detail and "0.62" in detail


def test_alignment_fails_without_rollout_logprobs() -> None:
    bad = GOOD.replace("rollout_probs_diff_valid:1", "rollout_probs_diff_valid:0")
    ok, detail = judge_alignment(parse_steps(bad))
    assert not ok and "calculate_log_probs" in detail
    assert not judge_alignment([])[0]


def test_smoke() -> None:
    line = ("(TaskRunner pid=1) ('Initial validation metrics: "
            "{'val-core/openai/gsm8k/reward/mean@1': '\n(TaskRunner pid=1) 'np.float64(0.1)}')")
    ok, detail = judge_smoke(parse_validation(line))
    assert ok and "reward/mean@1=0.1" in detail
    assert not judge_smoke(parse_validation("no validation here"))[0]
    assert not judge_smoke({"val-aux/len": 3.0})[0]
    wrapped = ("(T pid=9) (\"Initial validation metrics: {'val-aux/gsm8k/reward/mean@1': \"\n"
               "(T pid=9)  \"np.float64(0.25), 'val-core/gsm8k/acc/mean@1': np.float64(0.5), \"\n"
               "(T pid=9)  \"'val-aux/num_turns/mean': np.float64(2.0)}\")")
    assert parse_validation(wrapped) == {"val-aux/gsm8k/reward/mean@1": 0.25,
                                         "val-core/gsm8k/acc/mean@1": 0.5,
                                         "val-aux/num_turns/mean": 2.0}
    ok, detail = judge_smoke(parse_validation(wrapped))
    assert ok and "val-core/gsm8k/acc/mean@1=0.5" in detail, detail


def test_summary_uses_the_warm_steps_for_tokens_per_second() -> None:
    row = summary(parse_steps(GOOD), "kv")
    assert row == {"label": "kv", "steps": 2, "reward": 0.02, "first_gen_s": 3.5,
                   "gen_tokens_per_s": 100.0}
