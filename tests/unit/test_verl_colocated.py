"""Pure parts of the colocated weight path: settings, socket names, the transfer digest,
which shards a trainer rank feeds, the digest publish records, and the `updates` check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dynamod.integrations.verl.colocated import ColocatedSync
from dynamod.integrations.verl.config import parse_settings
from dynamod.integrations.verl.errors import RolloutConfigError
from dynamod.integrations.verl.ipc import WeightTransferError, socket_address, transfer_digest
from dynamod.integrations.verl.stack import Shard, parse_status
from dynamod.integrations.verl.validate import judge_updates
from dynamod.rollout.policy import agreed_digest


def test_weight_sync_settings() -> None:
    settings = parse_settings({"dynamod": {"weight_sync": "ipc", "ipc_bucket_mb": 64,
                                           "checkpoint_write": "inline", "ipc_dir": "/x"}})
    assert (settings.weight_sync, settings.ipc_bucket_mb) == ("ipc", 64)
    assert settings.checkpoint_write == "inline" and settings.ipc_dir == Path("/x")
    assert parse_settings({}).weight_sync == "push"
    with pytest.raises(RolloutConfigError) as err:
        parse_settings({"dynamod": {"weight_sync": "nccl"}})
    assert err.value.key == "actor_rollout_ref.rollout.engine_kwargs.dynamod.weight_sync"
    with pytest.raises(RolloutConfigError):
        parse_settings({"dynamod": {"ipc_bucket_mb": 0}})


def test_socket_address_names_the_shard_and_refuses_a_path_too_long() -> None:
    assert socket_address(Path("/tmp/s"), "worker@1", 2) == "ipc:///tmp/s/worker@1.rank2.sock"
    with pytest.raises(WeightTransferError, match="107-byte limit"):
        socket_address(Path("/tmp/" + "d" * 100), "worker@0")


def test_transfer_digest_ignores_order_and_sees_every_value() -> None:
    a, b = torch.arange(4.0), torch.ones(2, 3, dtype=torch.bfloat16)
    assert transfer_digest([("a", a), ("b", b)]) == transfer_digest([("b", b), ("a", a)])
    assert transfer_digest([("a", a)]) != transfer_digest([("a", a + 1)])
    assert transfer_digest([("a", a)]) != transfer_digest([("a", a.reshape(2, 2))])
    assert transfer_digest([("a", a)]) != transfer_digest([("a2", a)])


def shard(name: str) -> Shard:
    return Shard(name, "ready", "http://x", 1, True, ())


def test_each_trainer_rank_feeds_its_own_shards(tmp_path: Path) -> None:
    shards = [shard(f"worker@{i}") for i in (2, 0, 3, 1)]

    def owned(rank: int, world: int) -> list[str]:
        sync = ColocatedSync(tmp_path, tmp_path / "c", tmp_path / "i", rank=rank, world=world)
        return [s.name for s in sync.owned(shards)]

    assert owned(0, 1) == ["worker@0", "worker@1", "worker@2", "worker@3"]
    assert owned(0, 2) == ["worker@0", "worker@2"] and owned(1, 2) == ["worker@1", "worker@3"]


def test_on_a_cluster_each_node_s_ranks_share_that_node_s_shards(tmp_path: Path) -> None:
    """Ranks 0-1 on the head, 2-3 on n1: each node's dynamod lists only its own shards
    (every node has a worker@0), so rank 2 is n1's first rank, not a third of a list."""
    shards = [shard(f"worker@{i}") for i in (1, 0)]

    def owned(rank: int) -> list[str]:
        sync = ColocatedSync(tmp_path, tmp_path / "c", tmp_path / "i", rank=rank, world=4,
                             local_world=2)
        return [s.name for s in sync.owned(shards)]

    assert [owned(r) for r in range(4)] == [["worker@0"], ["worker@1"]] * 2


def test_a_cluster_node_names_its_shards_as_the_ledger_does() -> None:
    status = {"phase": "up", "units": [], "cluster": {"this_node": "n1", "head": "head"}}
    assert parse_status(status).ledger_name("worker@0") == "n1/worker@0"
    assert parse_status({"phase": "up", "units": []}).ledger_name("worker@0") == "worker@0"


def test_agreed_digest_is_the_majoritys() -> None:
    assert agreed_digest({"a": "x", "b": "x", "c": "y"}) == "x"
    assert agreed_digest({"a": None}) is None and agreed_digest(None) is None


def update(step: int, **overrides: Any) -> dict[str, Any]:
    record = {"step": step, "shards": ["worker@0", "worker@1"], "errors": {}, "stale": [],
              "acks": {"worker@0": "d", "worker@1": "d"}}
    return {**record, **overrides}


def test_updates_check_passes_when_every_shard_acknowledged_every_step() -> None:
    ok, detail = judge_updates([update(1), update(2)])
    assert ok, detail
    assert "2 updates (steps 1..2)" in detail


@pytest.mark.parametrize(("records", "why"), [
    ([], "no weight update was logged"),
    ([update(1, acks={"worker@0": "d"}, errors={"worker@1": "begin: no reply"})],
     "no acknowledgement from ['worker@1']"),
    ([update(1, acks={"worker@0": "d", "worker@1": "e"})], "different digests"),
    ([update(1, stale=["worker@1"])], "publish held ['worker@1']"),
    ([update(2), update(2)], "steps do not move forward"),
    ([update(1, shards=[])], "no admitted shard"),
    ([update(1, behind=["n1/worker@0"])], "other nodes' shards not at the step ['n1/worker@0']"),
])
def test_updates_check_fails(records: list[dict[str, Any]], why: str) -> None:
    ok, detail = judge_updates(records)
    assert not ok and why in detail, detail
