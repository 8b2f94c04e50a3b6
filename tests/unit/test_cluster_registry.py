"""The registry's records and the cluster view (pure): encode/decode, which nodes count
as lost, which shards are behind, and the rendered tree."""

from dynamod.cluster import registry
from dynamod.cluster.registry import LostRecord, NodeEntry, UnitEntry
from dynamod.control.render import cluster_tree

NODES = {"head": "10.1.0.1", "n1": "10.1.0.2", "n2": "10.1.0.3"}


def entry(node: str, version: int | None, current: int | None = 3) -> NodeEntry:
    units = [
        UnitEntry("worker@0", "worker", "ready", 42, {"system": 21000}, "ok", version, [0xAB],
                  shard=True),
        UnitEntry("model", "model", "completed", None, {}, "exited with status 0"),
    ]
    return NodeEntry(node, NODES[node], 100, "run", "up", node == "head", units, current)


def test_entries_and_lost_records_round_trip() -> None:
    e = entry("n1", 3)
    assert NodeEntry.decode(e.encode()) == e
    lost = LostRecord("n2", 1.0, "head", ["n2/worker@0"], ["ab"])
    assert LostRecord.decode(lost.encode()) == lost
    assert registry.node_key("s", "n1") == "dynamod/s/cluster/nodes/n1"
    assert registry.shard_id("n1", "worker@0") == "n1/worker@0"


def test_a_read_decodes_only_the_entries_whose_bytes_changed() -> None:
    cache = registry.EntryCache()
    raw = {n: entry(n, 3).encode().encode() for n in ("head", "n1")}
    first = {n: cache.decode(n, raw[n]) for n in raw}
    assert first == {n: entry(n, 3) for n in raw}
    again = {n: cache.decode(n, bytes(raw[n])) for n in raw}  # equal bytes, a new object
    assert all(again[n] is first[n] for n in raw)
    moved = cache.decode("n1", entry("n1", 4).encode().encode())
    assert moved is not first["n1"] and moved.units[0].policy_version == 4
    assert cache.decode("n1", raw["n1"]).units[0].policy_version == 3  # and back again
    cache.keep_only({"n1"})  # the head's entry expired: a new one is decoded afresh
    back = cache.decode("head", raw["head"])
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
