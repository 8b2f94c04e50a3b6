"""Which registrations the start-up sweep revokes (pure: `stale_leases`)."""

from __future__ import annotations

from dynamod.rollout.registrations import stale_leases


def test_every_registration_no_live_unit_owns_is_stale() -> None:
    # 1, 2: this stack's dead workers (recorded); 3: recorded by no stack
    assert stale_leases({1, 2, 3}, ours={1, 2}, others=set()) == {1, 2, 3}


def test_another_stacks_recorded_registration_is_kept() -> None:
    assert stale_leases({1, 7}, ours={1}, others={7}) == {1}


def test_our_recorded_lease_is_revoked_even_without_an_instance_key() -> None:
    # the worker's mdc / event-channel keys can outlive its instance key on the same lease
    assert stale_leases(set(), ours={4}, others=set()) == {4}


def test_nothing_registered_nothing_recorded_revokes_nothing() -> None:
    assert stale_leases(set(), ours=set(), others={9}) == set()
