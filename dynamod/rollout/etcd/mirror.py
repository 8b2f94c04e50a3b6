"""A prefix of etcd kept in memory: loaded by one read at a revision, then kept by a watch's
events from the revision after it, so a reader sees every key under the prefix without
reading the whole prefix again at every change."""

from __future__ import annotations

from collections.abc import Iterable

from dynamod.rollout.etcd.records import KeyValue, WatchEvent


class PrefixMirror:
    """The keys under a prefix as of `revision`: every change up to it applied, in order.

    Whoever feeds it must watch from `revision + 1` of the read it was loaded with, and
    drop it when the watch breaks in a way that can lose events (the client's own watch
    resumes without losing any; a compaction or every member failing raises)."""

    def __init__(self, kvs: Iterable[KeyValue], revision: int) -> None:
        self.kvs: dict[str, KeyValue] = {kv.key: kv for kv in kvs}
        self.loaded_at = revision
        self.revision = revision

    def apply(self, event: WatchEvent) -> None:
        """One change from the watch, in order. One at or before the read's revision is
        already in the copy (a watch opened from the revision after it sends none)."""
        if event.mod_revision <= self.loaded_at:
            return
        if event.kind == "delete":
            self.kvs.pop(event.key, None)
        else:
            self.kvs[event.key] = KeyValue(
                key=event.key, value=event.value, lease=event.lease,
                mod_revision=event.mod_revision,
            )  # fmt: skip
        self.revision = max(self.revision, event.mod_revision)

    def values(self) -> list[KeyValue]:
        """The keys in key order, as a read of the prefix returns them."""
        return [self.kvs[key] for key in sorted(self.kvs)]
