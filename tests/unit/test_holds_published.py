"""The policy manager's check, before a replay, of whether a shard already holds a
published step (fed by its own node's trainer ranks on a cluster): only a published step
with a digest, and only a shard reporting both its version and that digest, skips the load;
a load first checks the checkpoint is on this node's storage.
Pure logic (the shard's answer is a stand-in); tests/integration/test_cluster_colocated.py
runs it on two network-namespace nodes with real shards."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.rollout.ledger import PolicyVersion, _version_from
from dynamod.rollout.policy import PolicyError, PolicyManager, on_this_node
from dynamod.rollout.policy_table import PolicySpec
from dynamod.rollout.registrations import DynamoRegistrations


def _holds(how: str, digest: str | None, reports: dict[str, Any]) -> tuple[bool, list[str]]:
    service = PolicyManager(PolicySpec(shards=["worker"]), DynamoRegistrations())
    asked: list[str] = []

    async def step(name: str, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        asked.append(route)
        return reports

    target = PolicyVersion(7, "/ckpt/step-7", digest, 0.0, how)
    unit = SimpleNamespace(name="worker@0")
    held = asyncio.run(service._holds_published(unit, step, target))  # type: ignore[arg-type]
    return held, asked


def test_a_shard_reporting_the_published_step_and_digest_needs_no_load() -> None:
    assert _holds("publish", "d7", {"version": 7, "digest": "d7"}) == (
        True, ["get_weight_version"])  # fmt: skip


@pytest.mark.parametrize("reports", [
    {"version": 6, "digest": "d6"},     # it missed the step
    {"version": 7, "digest": "other"},  # fed other weights under the step's number
    {"version": 7, "digest": None},     # says nothing of what it holds
    {"version": 7},
])  # fmt: skip
def test_any_other_answer_loads_the_checkpoint(reports: dict[str, Any]) -> None:
    assert _holds("publish", "d7", reports) == (False, ["get_weight_version"])


@pytest.mark.parametrize(("how", "digest"), [("push", "d7"), ("publish", None)])
def test_a_pushed_step_or_one_without_a_digest_is_loaded_without_asking(
    how: str, digest: str | None
) -> None:
    assert _holds(how, digest, {"version": 7, "digest": "d7"}) == (False, [])


def test_a_checkpoint_missing_from_this_node_is_named_before_the_load(tmp_path: Path) -> None:
    here = tmp_path / "step-7"
    here.mkdir()
    asyncio.run(on_this_node(PolicyVersion(7, str(here), "d7", 0.0, "publish")))
    gone = PolicyVersion(8, str(tmp_path / "step-8"), "d8", 0.0, "push")
    with pytest.raises(PolicyError, match=r"version 8's checkpoint .*step-8 is not on this "
                       r"node's storage: .*storage every node reads"):
        asyncio.run(on_this_node(gone))


def _follow(records: list[PolicyVersion | None], held: tuple[int, str | None]) -> list[str]:
    """The reasons the follower held its one shard for, as the ledger showed `records` in
    turn; the shard holds version `held[0]` with digest `held[1]` throughout."""
    service = PolicyManager(PolicySpec(shards=["worker"]), DynamoRegistrations())
    unit = SimpleNamespace(name="worker@0")
    shard = SimpleNamespace(version=held[0], digest=held[1])
    rejoined: list[str] = []
    service.admitted_shards = lambda: [unit]  # type: ignore[method-assign]
    service.shard_policy = lambda u: shard  # type: ignore[method-assign,assignment,return-value]
    service._start_rejoin = (  # type: ignore[method-assign]
        lambda u, reason, known=None: rejoined.append(reason))
    service.note_current(None)  # the ledger was empty when the shard was admitted
    for record in records:
        asyncio.run(service.follow_ledger((record,)))
    return rejoined


def test_a_first_record_at_the_initial_version_is_replayed_into_the_boot_weights() -> None:
    """verl's first update is its step 0, which is the ledger's initial version 0: a node
    that did not commit it saw no new version, and its shards kept the boot weights (a
    push), or stayed paused where its ranks had fed them (a publish)."""
    published = PolicyVersion(0, "/ckpt/step-0", "d0", 1.0, "publish")
    reasons = _follow([published, published], held=(0, None))
    assert len(reasons) == 1 and "version 0 is a new publish (digest d0)" in reasons[0]
    # a publish fed the shard and paused it, even with the weights it had: checked again
    assert len(_follow([published], held=(0, "d0"))) == 1
    # the same record again, or a pushed one the shard already holds, holds nothing
    pushed = PolicyVersion(0, "/ckpt/step-0", "d0", 1.0, "push")
    assert _follow([pushed, pushed], held=(0, "d0")) == []
    assert len(_follow([pushed], held=(0, None))) == 1
    # a new version number is replayed as before
    assert _follow([PolicyVersion(1, "/ckpt/step-1", "d1", 2.0, "push")], held=(0, "d0")) == [
        "behind the ledger, which is at version 1"]


def test_the_node_that_committed_a_record_does_not_replay_it_as_read_back() -> None:
    """The committing node notes the record it wrote; the ledger hands back an equal one
    (the follow loop's every look), so no shard of it is replayed again, whatever its
    engine reports of digests."""
    written = PolicyVersion(0, "/ckpt/step-0", None, 1796663944.8818805, "push")
    read_back = _version_from(json.loads(json.dumps(asdict(written))))
    assert read_back == written
    service = PolicyManager(PolicySpec(shards=["worker"]), DynamoRegistrations())
    rejoined: list[str] = []
    service.admitted_shards = lambda: [SimpleNamespace(name="worker@0")]  # type: ignore[method-assign]
    service._start_rejoin = (  # type: ignore[method-assign]
        lambda u, reason, known=None: rejoined.append(reason))
    service.note_current(written)
    asyncio.run(service.follow_ledger((read_back,)))
    assert rejoined == []
