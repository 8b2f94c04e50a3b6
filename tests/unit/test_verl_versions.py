"""verl's step -> the ledger's version (pure): a fresh stack keeps verl's numbers; a ledger
ahead of verl moves the run after it; the offset holds for the run, so versions stay
consecutive; nothing goes backwards."""

from __future__ import annotations

from dynamod.integrations.verl.versions import StepVersions


def test_fresh_stack_versions_are_verl_steps() -> None:
    versions = StepVersions("run")
    assert [versions.version(s, 0, initial=True) for s in (0, 1, 2)] == [0, 1, 2]


def test_second_run_continues_after_the_ledger() -> None:
    versions = StepVersions("second")
    assert versions.version(0, 2, initial=False) == 3
    assert versions.version(1, 3, initial=False) == 4
    assert versions.version(2, 4, initial=False) == 5


def test_resumed_run_lands_after_the_ledger() -> None:
    # run 1 reached version 5 (its step 5), was killed, resumed from its step-4 checkpoint
    versions = StepVersions("resumed")
    assert versions.version(4, 5, initial=False) == 6
    assert versions.version(5, 6, initial=False) == 7


def test_a_step_already_ahead_keeps_its_number() -> None:
    versions = StepVersions("ahead")
    assert versions.version(7, 3, initial=False) == 7
    assert versions.version(8, 7, initial=False) == 8
