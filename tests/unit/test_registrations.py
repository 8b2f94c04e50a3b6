"""Which registrations the start-up sweep revokes (pure: `stale_leases`), and whose lease
records are whose (keys per node in a cluster stack)."""

from __future__ import annotations

from dynamod.rollout.ledger import LeaseRecord, lease_key, parse_lease_key
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


def test_lease_keys_name_the_node_in_a_cluster_and_not_on_one_node() -> None:
    assert lease_key("s", None, "worker@0") == "dynamod/s/leases/worker@0"
    assert lease_key("s", "n1", "worker@0") == "dynamod/s/leases/n1/worker@0"
    assert parse_lease_key("dynamod/s/leases/worker@0") == ("s", None, "worker@0")
    assert parse_lease_key("dynamod/s/leases/n1/worker@0") == ("s", "n1", "worker@0")


def test_keys_that_are_no_lease_record_are_not_parsed() -> None:
    for key in ("dynamod/s/policy/current", "dynamod/s/leases/", "dynamod/s/leases/n1/",
                "dynamod/s/leases//worker@0", "dynamod/s/leases/a/b/c", "other/s/leases/w",
                "dynamod/a/b/leases/w"):  # fmt: skip
        assert parse_lease_key(key) is None, key


def test_two_nodes_same_unit_name_own_separate_records() -> None:
    head = LeaseRecord("s", "worker@0", "ns", (1,), "head")
    n1 = LeaseRecord("s", "worker@0", "ns", (2,), "n1")
    legacy = LeaseRecord("s", "worker@0", "ns", (3,))
    other_stack = LeaseRecord("t", "worker@0", "ns", (4,), "n1")
    assert lease_key(head.stack, head.node, head.unit) != lease_key(n1.stack, n1.node, n1.unit)
    assert [r.owned_by("s", "n1") for r in (head, n1, legacy, other_stack)] == [
        False, True, True, False,
    ]  # fmt: skip
    # a single-node daemon owns only the single-node shape
    assert [r.owned_by("s", None) for r in (head, n1, legacy)] == [False, False, True]
