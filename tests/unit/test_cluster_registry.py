"""The registry's records and the cluster view (pure): encode/decode, which nodes count
as lost, which shards are behind, and the rendered tree."""

import json
from types import SimpleNamespace

import pytest

from dynamod.cluster import registry
from dynamod.cluster.registry import ForgottenRecord, LostRecord, NodeEntry, UnitEntry
from dynamod.control.render import cluster_tree

NODES = {"head": "10.1.0.1", "n1": "10.1.0.2", "n2": "10.1.0.3"}


def entry(node: str, version: int | None, current: int | None = 3) -> NodeEntry:
    units = [
        UnitEntry("worker@0", "worker", "ready", 42, {"system": 21000}, "ok", version, [0xAB],
                  shard=True),
        UnitEntry("model", "model", "completed", None, {}, "exited with status 0"),
    ]
    return NodeEntry(node, NODES[node], 100, "run", "up", node == "head", units, current)


def parts(e: NodeEntry, stack: str = "s") -> tuple[bytes, dict[str, bytes]]:
    """An entry as the registry holds it: its header's bytes, its units' by unit name."""
    records = e.records(stack)
    header = records.pop(registry.node_key(stack, e.node)).encode()
    return header, {key.rsplit("/", 1)[1]: value.encode() for key, value in records.items()}


def test_entries_and_lost_records_round_trip() -> None:
    e = entry("n1", 3)
    assert sorted(e.records("s")) == [
        "dynamod/s/cluster/nodes/n1",
        "dynamod/s/cluster/units/n1/model",
        "dynamod/s/cluster/units/n1/worker@0",
    ]
    assert NodeEntry.assemble(*parts(e)) == e
    lost = LostRecord("n2", 1.0, "head", ["n2/worker@0"], ["ab"])
    assert LostRecord.decode(lost.encode()) == lost
    assert registry.node_key("s", "n1") == "dynamod/s/cluster/nodes/n1"
    assert registry.shard_id("n1", "worker@0") == "n1/worker@0"


def test_a_lost_record_reads_older_and_newer_daemons_records() -> None:
    """A record without the heartbeat address (an older daemon's) reads with none; one with
    a field this version does not know (a newer daemon's) reads without it, where it broke
    the returning node's `_after_return` before; anything but an object is refused."""
    old = '{"by": "head", "node": "n2", "revoked": [], "shards": [], "since": 1.0}'
    assert LostRecord.decode(old).heartbeat_port is None
    record = LostRecord("n2", 1.0, "head", [], [], address="10.0.0.2", heartbeat_port=4001)
    newer = json.dumps({**json.loads(record.encode()), "lost_for": "a later field"})
    assert LostRecord.decode(newer) == record
    with pytest.raises(ValueError, match="not a JSON object"):
        LostRecord.decode("[]")
    with pytest.raises(TypeError):
        LostRecord.decode('{"node": "n2"}')  # a record's own fields are still required


def test_a_units_change_rewrites_its_own_key_not_the_whole_entry() -> None:
    """At 8 x 32 a push rewrote each node's ~10 KB entry ~30 times (2.4 MB of its 3.0 MB of
    etcd writes): a shard's new version now changes one small key."""
    before, after = entry("n1", 2).records("s"), entry("n1", 3).records("s")
    changed = [k for k in after if before[k] != after[k]]
    assert changed == ["dynamod/s/cluster/units/n1/worker@0"]
    assert len(after[changed[0]]) < 300


def test_an_entry_leaves_out_a_unit_its_header_names_but_the_read_lacks() -> None:
    header, units = parts(entry("n1", 3))
    del units["model"]  # its transaction not read yet
    assert [u.name for u in NodeEntry.assemble(header, units).units] == ["worker@0"]
    units["stray"] = units["worker@0"]  # a key no header names (an old run's): not shown
    assert [u.name for u in NodeEntry.assemble(header, units).units] == ["worker@0"]
    units["model"] = b'{"name": "model", "forged": true}'  # overwritten by something else
    bad: list[tuple[str, str]] = []
    assert [u.name for u in NodeEntry.assemble(header, units, bad).units] == ["worker@0"]
    assert [unit for unit, _ in bad] == ["model"]  # named, and the node is still there


def test_the_writes_of_an_entry_go_units_first_in_transactions_etcd_takes() -> None:
    many = NodeEntry("n1", "10.1.0.2", 1, "run", "up", False,
                     [UnitEntry(f"worker@{i}", "worker", "ready", i, {}, "") for i in range(250)])
    records = many.records("s")
    header = registry.node_key("s", "n1")
    txns = registry.entry_writes("s", "n1", records, ["dynamod/s/cluster/units/n1/gone"], 7)
    assert [len(t) for t in txns] == [100, 100, 52]
    ops = [op for t in txns for op in t]
    assert [op.key for op in ops[-2:]] == [header, "dynamod/s/cluster/units/n1/gone"]
    assert type(ops[-1]).__name__ == "TxnDelete"
    assert all(getattr(op, "lease", 7) == 7 for op in ops)
    assert registry.entry_writes("s", "n1", {}, [], 7) == []


def test_a_read_assembles_each_nodes_entry_and_names_bad_records() -> None:
    base = registry.prefix("s")
    rows = [SimpleNamespace(key=k, value=v.encode())
            for n in ("head", "n1") for k, v in entry(n, 3).records("s").items()]  # fmt: skip
    rows += [SimpleNamespace(key=f"{base}leader", value=b"head"),
             SimpleNamespace(key=f"{base}down", value=b"[1]"),
             SimpleNamespace(key=f"{base}nodes/n2", value=b"{"),
             SimpleNamespace(key=f"{base}units/n1/model", value=b"[]")]  # fmt: skip
    found = registry.parse("s", rows, registry.EntryCache())
    assert found.entries["head"] == entry("head", 3) and found.leader == "head"
    assert found.entries["n1"].units == entry("n1", 3).units[:1]  # its bad unit left out
    assert found.down is None and set(found.entries) == {"head", "n1"}
    assert sorted(key for key, _ in found.bad) == [
        f"{base}down", f"{base}nodes/n2", f"{base}units/n1/model"]


def test_a_read_decodes_only_the_entries_whose_bytes_changed() -> None:
    cache = registry.EntryCache()
    raw = {n: parts(entry(n, 3)) for n in ("head", "n1")}
    first = {n: cache.decode(n, *raw[n]) for n in raw}
    assert first == {n: entry(n, 3) for n in raw}
    again = {n: cache.decode(n, bytes(raw[n][0]), dict(raw[n][1])) for n in raw}  # new objects
    assert all(again[n] is first[n] for n in raw)
    moved = cache.decode("n1", *parts(entry("n1", 4)))
    assert moved is not first["n1"] and moved.units[0].policy_version == 4
    assert cache.decode("n1", *raw["n1"]).units[0].policy_version == 3  # and back again
    cache.keep_only({"n1"})  # the head's entry expired: a new one is decoded afresh
    back = cache.decode("head", *raw["head"])
    assert back == first["head"] and back is not first["head"]


def test_a_vanished_entry_is_lost_except_while_the_cluster_stops() -> None:
    before = {n: entry(n, 3) for n in NODES}
    now = {n: before[n] for n in ("head", "n1")}
    assert registry.newly_lost(before, now, stopping=False) == ["n2"]
    assert registry.newly_lost(before, now, stopping=True) == []
    assert registry.newly_lost(now, before, stopping=False) == []
    seen = set(NODES)
    assert registry.node_state("n2", now, {}, seen) is registry.NodeState.LOST
    assert registry.node_state("n2", now, {}, set()) is registry.NodeState.UNKNOWN
    assert registry.node_state("n1", now, {}, seen) is registry.NodeState.UP


def test_the_view_marks_lost_nodes_and_names_shards_behind() -> None:
    entries = {"head": entry("head", 3), "n1": entry("n1", 2)}
    lost = {"n2": LostRecord("n2", 1.0, "head", ["n2/worker@0"], ["ab"])}
    view = registry.view(NODES, "head", "n1", entries, lost, set(NODES), "head", None)
    rows = {n["name"]: n for n in view["nodes"]}
    assert [rows[n]["state"] for n in NODES] == ["up", "up", "lost"]
    assert rows["n2"]["lost"]["revoked"] == ["ab"] and rows["n2"]["units"] == []
    assert view["policy_current"] == 3 and view["behind"] == ["n1"]
    assert rows["n1"]["behind"] == ["n1/worker@0"] and rows["head"]["behind"] == []
    text = "\n".join(cluster_tree(view))
    assert "behind the current policy version: n1" in text
    assert "└─ n2" in text and "lost" in text and "marked lost by head" in text
    assert "├─ head (head)" in text and "v2" in text


def test_a_forgotten_node_shows_forgotten_until_its_entry_comes_back() -> None:
    """`cluster forget`: the forgotten record outranks a lost record and this daemon's
    memory of the node; an entry (the node came back after all) outranks both."""
    base = registry.prefix("s")
    gone = ForgottenRecord("n2", "n1", 1700000000.0)
    assert ForgottenRecord.decode(gone.encode()) == gone
    with pytest.raises(ValueError, match="not a JSON object"):
        ForgottenRecord.decode("[]")
    rows = [SimpleNamespace(key=registry.forgotten_key("s", "n2"), value=gone.encode().encode()),
            SimpleNamespace(key=f"{base}forgotten/n1", value=b"{}")]  # fmt: skip
    found = registry.parse("s", rows, registry.EntryCache())
    assert found.forgotten == {"n2": gone}
    assert [key for key, _ in found.bad] == [f"{base}forgotten/n1"]
    entries = {"head": entry("head", 3), "n1": entry("n1", 3)}
    lost = {"n2": LostRecord("n2", 1.0, "head", ["n2/worker@0"], ["ab"])}
    forgotten = {"n2": gone}
    state = registry.node_state
    assert state("n2", entries, lost, set(NODES), forgotten) is registry.NodeState.FORGOTTEN
    assert state("n2", entries, {}, set(), forgotten) is registry.NodeState.FORGOTTEN
    assert state("n2", {**entries, "n2": entry("n2", 3)}, lost, set(NODES),
                 forgotten) is registry.NodeState.UP  # fmt: skip
    assert state("n2", entries, lost, set(NODES)) is registry.NodeState.LOST
    view = registry.view(NODES, "head", "n1", entries, lost, set(NODES), "head", None, forgotten)
    n2 = {n["name"]: n for n in view["nodes"]}["n2"]
    assert n2["state"] == "forgotten" and n2["lost"] is None
    assert n2["forgotten"] == {"node": "n2", "by": "n1", "at": 1700000000.0}
    text = "\n".join(cluster_tree(view))
    assert "forgotten" in text and "gone for good, said on n1" in text
    assert "marked lost" not in text


def test_each_node_reaches_the_registry_through_its_own_member_first() -> None:
    urls = ["https://10.77.0.1:2379", "https://10.77.0.2:2379", "https://10.77.0.3:2379"]
    assert registry.local_first(urls, "10.77.0.2") == [urls[1], urls[0], urls[2]]
    assert registry.local_first(urls, "10.77.0.1") == urls
    # no member on this node (the quick cluster: one etcd on the head): the order is kept
    assert registry.local_first(urls, "10.77.0.9") == urls
    assert registry.local_first(["10.77.0.1:2379", "10.77.0.3:2379"], "10.77.0.3") == [
        "10.77.0.3:2379",
        "10.77.0.1:2379",
    ]


def test_a_registry_call_waits_on_one_silent_member_for_at_most_a_quarter_of_the_lease() -> None:
    assert registry.call_timeout(2.0, 1.0) == 0.5
    assert registry.call_timeout(10.0, 1.0) == 1.0
    # the keepalive period (a third), one call given up, one that answers: within the lease
    for ttl in (1.0, 2.0, 3.0, 6.0):
        assert ttl / 3 + registry.call_timeout(ttl, 1.0) < ttl * 0.6 + 1e-9


def test_cluster_forget_says_what_went_in_one_line() -> None:
    from dynamod.control.commands.cluster import _said

    done = {"node": "n2", "was_lost": True, "state": "forgotten", "shards": ["n2/worker@0"],
            "lease_records": ["worker@0"], "ledger_records": ["worker@0"],
            "revoked": {"694d": 5}, "revoke_error": None}  # fmt: skip
    assert _said(done) == (
        "n2 forgotten (it was lost; now forgotten): shards n2/worker@0; lease records of "
        "worker@0; ledger acks of worker@0; revoked leases 694d (5 keys)"
    )
    bare = {**done, "was_lost": False, "shards": [], "lease_records": [], "ledger_records": [],
            "revoked": {}, "revoke_error": "revoking lease 694d: etcd unavailable"}  # fmt: skip
    said = _said(bare)
    assert said.startswith("n2 forgotten (it was not marked lost; now forgotten): nothing else")
    assert said.endswith("not revoked: revoking lease 694d: etcd unavailable (its lease expires "
                         "on its own)")  # fmt: skip
