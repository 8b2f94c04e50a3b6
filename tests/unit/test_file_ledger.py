"""The single-node ledger (a JSON file): one shard's record read alone, as the etcd
ledger's (test_etcd_client.py)."""

from __future__ import annotations

from pathlib import Path

from dynamod.rollout.ledger import FileLedger, ShardRecord


async def test_one_shard_s_record_reads_back_and_an_absent_one_is_none(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "policy.json")
    assert await ledger.shard("worker@0") is None  # no file yet
    records = [ShardRecord(f"worker@{i}", 3, "d", 1.5, None) for i in range(3)]
    await ledger.record_shards(records)
    await ledger.record_shards([ShardRecord("worker@1", 3, "d", 1.5, "replay failed")])
    assert await ledger.shard("worker@1") == ShardRecord("worker@1", 3, "d", 1.5, "replay failed")
    assert await ledger.shard("worker@2") == records[2]
    assert await ledger.shard("worker@9") is None
