"""The single-node ledger (a JSON file): one shard's record read alone, as the etcd
ledger's (test_etcd_client.py)."""

from __future__ import annotations

from pathlib import Path

from dynamod.rollout.ledger import FileLedger, PolicyVersion, ShardRecord


async def test_one_shard_s_record_reads_back_and_an_absent_one_is_none(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "policy.json")
    assert await ledger.shard("worker@0") is None  # no file yet
    records = [ShardRecord(f"worker@{i}", 3, "d", 1.5, None) for i in range(3)]
    await ledger.record_shards(records)
    await ledger.record_shards([ShardRecord("worker@1", 3, "d", 1.5, "replay failed")])
    assert await ledger.shard("worker@1") == ShardRecord("worker@1", 3, "d", 1.5, "replay failed")
    assert await ledger.shard("worker@2") == records[2]
    assert await ledger.shard("worker@9") is None


async def test_an_advance_records_its_shards_in_the_same_write(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "policy.json")
    assert await ledger.versions() == (None, [])
    records = [ShardRecord(f"worker@{i}", 2, "d2", 1.5, None) for i in range(3)]
    for step in (1, 2):
        left = await ledger.advance(
            PolicyVersion(step, f"/ckpt/{step}", "d2", 0.0, "push"), 1, records if step == 2 else ()
        )
        assert left == []
    current, history = await ledger.versions()
    assert current is not None and current.version == 2 and [v.version for v in history] == [2]
    assert await ledger.shards() == {r.name: r for r in records}
