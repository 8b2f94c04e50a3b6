"""GRPO arithmetic (dynamod.trainer.grpo): rewards, group advantages, log-probs, loss."""

from __future__ import annotations

import math

import pytest
import torch

from dynamod.trainer import grpo

# ------------------------------------------------------------------------- rewards


def test_fraction_reward_counts_target_tokens() -> None:
    assert grpo.fraction_reward([1, 2, 3, 4], {2, 4}) == 0.5
    assert grpo.fraction_reward([5, 5, 5], {5}) == 1.0
    assert grpo.fraction_reward([1, 3], {2}) == 0.0


def test_fraction_reward_of_an_empty_completion_is_zero() -> None:
    assert grpo.fraction_reward([], {1}) == 0.0


def test_fold_into_vocab_is_identity_in_range_and_wraps_outside() -> None:
    assert grpo.fold_into_vocab([0, 5, 511], 512) == [0, 5, 511]
    assert grpo.fold_into_vocab([1000, 1999, 512], 512) == [488, 463, 0]
    with pytest.raises(ValueError):
        grpo.fold_into_vocab([1], 0)


def test_word_start_ids_pick_tokens_with_the_space_marker() -> None:
    vocab = {"\u0120the": 7, "the": 8, "\u0120": 9, "<s>": 1}
    assert grpo.word_start_ids(vocab) == frozenset({7, 9})


# ----------------------------------------------------------------------- advantages


def test_group_advantages_are_zero_mean_unit_std() -> None:
    adv = grpo.group_advantages([0.0, 0.25, 0.5, 1.0])
    assert math.isclose(sum(adv), 0.0, abs_tol=1e-9)
    assert math.isclose(math.sqrt(sum(a * a for a in adv) / len(adv)), 1.0, rel_tol=1e-9)
    assert adv == sorted(adv)  # order of rewards preserved


def test_two_member_group_gets_plus_minus_one() -> None:
    assert grpo.group_advantages([0.2, 0.8]) == pytest.approx([-1.0, 1.0])


def test_zero_variance_group_has_zero_advantages() -> None:
    assert grpo.group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert grpo.group_advantages([0.5]) == [0.0]
    assert grpo.group_advantages([]) == []


def test_advantages_do_not_depend_on_reward_offset_or_scale() -> None:
    base = grpo.group_advantages([0.1, 0.4, 0.2])
    assert grpo.group_advantages([10.3, 11.2, 10.6]) == pytest.approx(base)


# --------------------------------------------------------------- log-probs and loss


def test_token_logprobs_score_the_next_token() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2
    logits[0, 1, 1] = 10.0  # position 1 predicts token 1
    ids = torch.tensor([[0, 2, 3]])
    lp = grpo.token_logprobs(logits, ids)
    assert lp.shape == (1, 2)
    assert lp[0, 0] > -0.01  # token 2 was the likely one
    assert lp[0, 1] < -9.0  # token 3 was not


def test_completion_mask_covers_exactly_the_completion_columns() -> None:
    mask = grpo.completion_mask([2, 3], [3, 1], length=6)
    assert mask.tolist() == [
        [0.0, 1.0, 1.0, 1.0, 0.0],
        [0.0, 0.0, 1.0, 0.0, 0.0],
    ]
    with pytest.raises(ValueError):
        grpo.completion_mask([0], [1], length=2)


def test_loss_is_minus_advantage_times_mean_completion_logprob() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -4.0, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    # row 0: mean(-2, -3) = -2.5; row 1: -4
    expected = -((2.0 * -2.5) + (-1.0 * -4.0)) / 2
    assert grpo.policy_loss(logprobs, mask, adv).item() == pytest.approx(expected)


def test_loss_gradient_raises_positive_and_lowers_negative_advantage() -> None:
    logprobs = torch.tensor([[-2.0, -2.0], [-2.0, -2.0]], requires_grad=True)
    mask = torch.ones(2, 2)
    loss = grpo.policy_loss(logprobs, mask, torch.tensor([1.0, -1.0]))
    loss.backward()
    assert logprobs.grad is not None
    # Gradient descent moves against the gradient: up for advantage > 0, down for < 0.
    assert (logprobs.grad[0] < 0).all()
    assert (logprobs.grad[1] > 0).all()


def test_rows_without_completion_tokens_contribute_nothing() -> None:
    logprobs = torch.tensor([[-1.0, -1.0], [-5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss = grpo.policy_loss(logprobs, mask, torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx(0.5)  # -(1 * -1 + 1 * 0) / 2


def test_a_gradient_step_makes_a_rewarded_completion_more_likely() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6, requires_grad=True)
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0]])
    mask = grpo.completion_mask([2, 2], [2, 2], length=4)
    adv = torch.tensor([1.0, -1.0])

    def mean_lp() -> torch.Tensor:
        lp = grpo.token_logprobs(logits, ids)
        return (lp * mask).sum(-1) / mask.sum(-1)

    before = mean_lp().detach()
    grpo.policy_loss(grpo.token_logprobs(logits, ids), mask, adv).backward()
    with torch.no_grad():
        assert logits.grad is not None
        logits -= 0.5 * logits.grad
    after = mean_lp().detach()
    assert after[0] > before[0]
    assert after[1] < before[1]
