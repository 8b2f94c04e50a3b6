"""PrefixMirror: a read at a revision, then the watch's events after it, make the same keys
as the store holds, whatever the changes and wherever the read fell among them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamod.rollout.etcd import KeyValue, WatchEvent
from dynamod.rollout.etcd.mirror import PrefixMirror

KEYS = st.sampled_from(["p/nodes/a", "p/nodes/b", "p/units/a/w@0", "p/units/a/w@1", "p/leader"])
# (key, value or None for a delete, lease, whether it shares the last change's revision)
CHANGES = st.lists(
    st.tuples(KEYS, st.none() | st.binary(max_size=8), st.integers(0, 3), st.booleans()),
    max_size=40,
)


def _store(changes: list[tuple[str, bytes | None, int, bool]]) -> list[tuple[int, WatchEvent]]:
    """The changes as etcd would number them (one in a transaction with the one before
    shares its revision, never its key) and report them to a watch."""
    revision, keys_at, out = 1, set[str](), []
    for key, value, lease, same_txn in changes:
        if not (same_txn and key not in keys_at and out):
            revision, keys_at = revision + 1, set()
        keys_at.add(key)
        kind = "put" if value is not None else "delete"
        out.append((revision, WatchEvent(kind, key, value or b"", revision, lease if value is not None else 0)))  # type: ignore[arg-type]  # noqa: E501
    return out


def _state(events: list[tuple[int, WatchEvent]]) -> dict[str, KeyValue]:
    kvs: dict[str, KeyValue] = {}
    for _, e in events:
        if e.kind == "delete":
            kvs.pop(e.key, None)
        else:
            kvs[e.key] = KeyValue(e.key, e.value, e.lease, e.mod_revision)
    return kvs


@given(CHANGES, st.integers(0, 40), st.integers(0, 5))
def test_a_read_and_the_events_after_it_make_the_store_s_keys(
    changes: list[tuple[str, bytes | None, int, bool]], cut: int, replayed: int
) -> None:
    events = _store(changes)
    # the read falls between two revisions: every change up to it is in the read
    revisions = sorted({r for r, _ in events}) or [1]
    read_at = revisions[min(cut, len(revisions) - 1)] if events else 1
    before = [(r, e) for r, e in events if r <= read_at]
    after = [e for r, e in events if r > read_at]
    mirror = PrefixMirror(_state(before).values(), read_at)
    for _, e in before[len(before) - replayed :] if replayed else []:
        mirror.apply(e)  # an event the read already holds, sent again: changes nothing
    for e in after:
        mirror.apply(e)
    assert mirror.kvs == _state(events)
    assert [kv.key for kv in mirror.values()] == sorted(mirror.kvs)
    assert mirror.revision == max([read_at, *(e.mod_revision for e in after)])


def test_a_delete_removes_and_a_put_carries_its_lease_and_revision() -> None:
    mirror = PrefixMirror([KeyValue("p/a", b"1", 5, 3), KeyValue("p/b", b"2", 5, 4)], 4)
    mirror.apply(WatchEvent("delete", "p/a", b"", 5))
    mirror.apply(WatchEvent("put", "p/b", b"3", 6, 9))
    mirror.apply(WatchEvent("put", "p/a", b"stale", 4, 5))  # before the read: ignored
    assert mirror.values() == [KeyValue("p/b", b"3", 9, 6)]
    assert mirror.revision == 6
