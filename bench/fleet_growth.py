"""Pure logic of bench.fleet: the fleet sizes asked for, how a measured value grows with the
number of nodes (the exponent of a power law through the points), and etcd's Prometheus
counters read from its /metrics text."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.samples import Sample

# etcd's own counters: keys in the store, live watchers, the store's revision (one per
# write transaction), the reads (ranges) and the keys written (put or deleted) since it started
ETCD_METRICS = {
    "keys": "etcd_debugging_mvcc_keys_total",
    "watchers": "etcd_debugging_mvcc_watcher_total",
    "watch_streams": "etcd_debugging_mvcc_watch_stream_total",
    "revision": "etcd_debugging_mvcc_current_revision",
    "ranges": "etcd_mvcc_range_total",  # reads
    "puts": "etcd_mvcc_put_total",
    "deletes": "etcd_mvcc_delete_total",
    # the store's file and the part of it in use: what history etcd keeps (every revision
    # of every key until a compaction) grows the second
    "db_bytes": "etcd_mvcc_db_total_size_in_bytes",
    "db_in_use_bytes": "etcd_mvcc_db_total_size_in_use_in_bytes",
}
WRITES = ("puts", "deletes")


class SizesError(ValueError):
    """A `--nodes` or `--shards-per-node` value bench.fleet cannot run."""


def parse_sizes(text: str, most: int) -> list[int]:
    """`1,2,4,8` -> [1, 2, 4, 8]: distinct, rising, each 1..most."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SizesError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes:
        raise SizesError("no size given")
    if sizes != sorted(set(sizes)):
        raise SizesError(f"{text!r}: sizes must rise, each once")
    if sizes[0] < 1 or sizes[-1] > most:
        raise SizesError(f"{text!r}: each size must be 1 to {most}")
    return sizes


def exponent(points: Iterable[tuple[float, float | None]]) -> float:
    """b of value ~ a * n**b, least squares in log-log over the points with a positive
    value (NaN with fewer than two sizes). 1 is linear growth, 0 flat, 2 quadratic."""
    usable = [
        (math.log(n), math.log(v))
        for n, v in points
        if v is not None and n > 0 and math.isfinite(v) and v > 0
    ]
    if len({x for x, _ in usable}) < 2:
        return math.nan
    mx = sum(x for x, _ in usable) / len(usable)
    my = sum(y for _, y in usable) / len(usable)
    sxx = sum((x - mx) ** 2 for x, _ in usable)
    sxy = sum((x - mx) * (y - my) for x, y in usable)
    return sxy / sxx


def faster_than_linear(points: Sequence[tuple[float, float | None]], margin: float = 0.25) -> bool:
    """Whether the value grows faster than the node count: its exponent above 1 + margin
    (the margin absorbs a loaded machine's noise between two sizes)."""
    b = exponent(points)
    return not math.isnan(b) and b > 1 + margin


def prometheus(samples: list[Sample], names: dict[str, str]) -> dict[str, float]:
    """The named unlabelled (or summed over labels) samples of a /metrics text (its
    `metric_samples`, parsed once by the caller): {our name: value}; a metric the text
    lacks is NaN."""
    wanted = {metric: ours for ours, metric in names.items()}
    found = {ours: math.nan for ours in names}
    for sample in samples:
        if sample.name in wanted:
            ours = wanted[sample.name]
            base = 0.0 if math.isnan(found[ours]) else found[ours]
            found[ours] = base + sample.value
    return found


def writes(before: dict[str, float], after: dict[str, float]) -> float:
    """Keys etcd wrote (put or deleted) between two readings."""
    return sum(after[k] - before[k] for k in WRITES)


def history_kb(before: dict[str, float], after: dict[str, float]) -> float:
    """KB the store's part in use grew by between two readings: what etcd kept of the
    writes meanwhile (every revision stays until a compaction frees it; page-sized steps,
    and a compaction meanwhile makes it smaller or negative)."""
    return (after["db_in_use_bytes"] - before["db_in_use_bytes"]) / 1024


# A shard on the mocker engine holds two of Dynamo's runtimes with file discovery, each an
# inotify instance; the kernel allows fs.inotify.max_user_instances per user (128 by default)
INOTIFY_PER_SHARD = 2
INOTIFY_RESERVE = 16  # for everything else of this user meanwhile


def shards_that_fit(limit: int, in_use: int) -> int:
    """How many mocker-engine shards the inotify instances left to this user hold."""
    return max(0, (limit - in_use - INOTIFY_RESERVE) // INOTIFY_PER_SHARD)


def pick(fleet: dict[str, Any], *path: str) -> Any:
    """fleet[a][b]... or NaN where a phase did not run (a 1-node fleet has no cut)."""
    value: Any = fleet
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return math.nan
        value = value[key]
    return value


GROWTH = {  # label -> path in a fleet's result
    "start until every shard routed, s": ("up_s",),
    "push: trainer's stall, s": ("push", "stall_s"),
    "push: daemon's total, s": ("push", "daemon_s"),
    "push: the head's slowest shard's own time, ms": ("push", "shard_max_ms"),
    "push: the daemons' CPU, s": ("push", "cpu", "daemons_s"),
    "push: the shards' CPU, s": ("push", "cpu", "shards_s"),
    "push --serving 1: trainer's stall, s": ("early", "stall_s"),
    "push --serving 1: every shard at the step, s": ("early", "every_shard_s"),
    "status --json, slowest node, s": ("status", "max_s"),
    "status: daemon's answer, slowest node, ms": ("status", "answer_max_ms"),
    "status --json size, KB": ("status", "json_kb"),
    "etcd keys": ("push", "etcd_after", "keys"),
    "etcd watchers": ("push", "etcd_after", "watchers"),
    "etcd keys written per push": ("push", "etcd_writes"),
    "etcd reads / s, idle": ("idle", "etcd_reads_per_s"),
    "etcd keys written / s, idle": ("idle", "etcd_writes_per_s"),
    "etcd history KB per push": ("push", "etcd_history_kb"),
    "cut: out of routing, s": ("cut", "rerouted_s"),
    "kill 10 %: serving again, s": ("kill", "back_s"),
    "daemon CPU % per shard (idle)": ("idle", "daemon_cpu_pct_per_shard"),
    "identity look, all of dynamod/ read: CPU ms": ("identity", "whole", "cpu_ms"),
    "identity look, stack by stack: CPU ms": ("identity", "by_stack", "cpu_ms"),
    "daemon RSS MB per shard": ("idle", "daemon_rss_mb_per_shard"),
    "shard PSS MB": ("idle", "shard_pss_mb"),
}
