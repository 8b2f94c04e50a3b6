"""bench.fleet's pure logic: the sizes it accepts, the growth exponent that names what grows
faster than linearly, etcd's counters read from a /metrics text, the shards the inotify
instances hold (and the limit raised for a run and put back), and its stack (the stock
cluster stack with a replicated etcd)."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from bench import fleet
from bench.fleet_early import (
    DISK,
    SLOW_LE,
    TXN,
    disk_counts,
    disk_since,
    raft_leader,
    slow_disk,
    slowest_txn,
)
from bench.fleet_growth import (
    ETCD_METRICS,
    SizesError,
    exponent,
    faster_than_linear,
    parse_sizes,
    prometheus,
    shards_that_fit,
    writes,
)
from bench.fleet_stack import (
    StackShapeError,
    members,
    replicated,
    with_max_starting,
    with_max_updating,
)
from bench.fleet_threads import ENDED, by_thread, group, threads_of
from dynamod.core import paths
from dynamod.rollout.dynamo import metric_samples

NODES = [1, 2, 4, 8]


def test_exponent_of_flat_linear_and_quadratic_growth() -> None:
    assert exponent([(n, 5.0) for n in NODES]) == pytest.approx(0.0)
    assert exponent([(n, 3.0 * n) for n in NODES]) == pytest.approx(1.0)
    assert exponent([(n, 0.5 * n * n) for n in NODES]) == pytest.approx(2.0)


def test_quadratic_growth_is_named_faster_than_linear() -> None:
    assert faster_than_linear([(n, float(n * n)) for n in NODES])
    assert faster_than_linear([(1, 1.0), (8, 20.0)])  # b = 1.44


def test_linear_flat_and_noisy_linear_growth_are_not() -> None:
    assert not faster_than_linear([(n, 2.0 * n) for n in NODES])
    assert not faster_than_linear([(n, 1.0) for n in NODES])
    assert not faster_than_linear([(1, 1.0), (2, 2.3), (4, 4.1), (8, 8.5)])


def test_missing_values_are_left_out_and_one_size_says_nothing() -> None:
    assert math.isnan(exponent([(2, 1.0)]))
    assert math.isnan(exponent([(1, math.nan), (2, 4.0)]))
    assert math.isnan(exponent([(1, None), (2, 0.0), (4, 3.0)]))
    assert not faster_than_linear([(2, 1.0)])
    assert exponent([(1, math.nan), (2, 4.0), (4, 16.0)]) == pytest.approx(2.0)


def test_parse_sizes() -> None:
    assert parse_sizes("1,2,4,8", 8) == NODES
    assert parse_sizes("3", 8) == [3]
    for bad in ("", "2,1", "1,1", "0,2", "1,9", "a"):
        with pytest.raises(SizesError):
            parse_sizes(bad, 8)


METRICS = """# HELP etcd_debugging_mvcc_keys_total Total number of keys.
# TYPE etcd_debugging_mvcc_keys_total gauge
etcd_debugging_mvcc_keys_total 64
etcd_debugging_mvcc_watcher_total 14
etcd_debugging_mvcc_current_revision 1200
etcd_mvcc_put_total 300
etcd_mvcc_delete_total{kind="x"} 2
etcd_mvcc_delete_total{kind="y"} 3
etcd_mvcc_put_total_other 999
"""


def test_prometheus_reads_and_sums_labelled_samples() -> None:
    found = prometheus(metric_samples(METRICS), ETCD_METRICS)
    assert found["keys"] == 64 and found["watchers"] == 14 and found["revision"] == 1200
    assert found["puts"] == 300  # not the metric whose name merely starts the same
    assert found["deletes"] == 5
    assert math.isnan(found["watch_streams"])  # absent from the text
    after = {**found, "puts": 325.0, "deletes": 6.0}
    assert writes(found, after) == 26


def test_shards_that_fit_the_inotify_instances_left() -> None:
    assert shards_that_fit(128, 0) == 56  # the kernel's default, nothing else running
    assert shards_that_fit(128, 100) == 6
    assert shards_that_fit(128, 128) == 0  # never negative
    assert shards_that_fit(1024, 0) >= 256  # what 8 x 32 needs


def test_the_fleet_stack_has_three_etcd_members_from_three_nodes_on() -> None:
    stock = (paths.units_dir() / "stacks" / "cluster.toml").read_text()
    nodes = ["head", "n1", "n2", "n3"]
    assert members(nodes) == ["head", "n1", "n2"]
    assert members(nodes[:2]) == ["head"]  # two members: either one lost, no quorum
    text = replicated(stock, nodes, paths.units_dir())
    stack = tomllib.loads(text)
    assert '"../' not in text
    assert stack["units"]["etcd"]["nodes"] == ["head", "n1", "n2"]
    initial = stack["units"]["etcd"]["command"]
    initial = initial[initial.index("--initial-cluster") + 1]
    assert initial.count("=http://") == 3 and "n1=http://{cluster.nodes.n1}" in initial
    urls = stack["vars"]["etcd_url"].split(",")
    assert len(urls) == 3 and len(stack["cluster"]["registry"]) == 3
    assert stack["policy"]["etcd"] == "{vars.etcd_url}"  # the ledger reaches every member
    # Dynamo's processes through each node's etcd relay, as in the stock replicated stack
    assert any(i.endswith("/cluster/etcd-relay.toml") for i in stack["stack"]["include"])
    assert stack["vars"]["etcd_urls"] == stack["vars"]["etcd_url"]  # the relay's members
    for unit in ("worker", "frontend"):
        assert stack["units"][unit]["env"]["ETCD_ENDPOINTS"] == "{vars.dynamo_etcd_url}"
        assert stack["units"][unit]["depends_on"]["etcd-relay"] == "ready"
    assert stack["vars"]["dynamo_etcd_url"].startswith("http://127.0.0.1:")
    assert stack["units"]["worker"]["dynamo"]["etcd"] == "{vars.etcd_url}"  # dynamod's own
    alone = tomllib.loads(replicated(stock, nodes[:2], paths.units_dir()))
    assert alone["units"]["etcd"]["nodes"] == ["head"]
    assert alone["units"]["worker"]["env"]["ETCD_ENDPOINTS"] == "{vars.etcd_url}"  # no relay
    direct = tomllib.loads(replicated(stock, nodes, paths.units_dir(), relay=False))
    assert "etcd-relay" not in direct["units"]
    assert direct["units"]["etcd"]["nodes"] == members(nodes)
    for unit in ("worker", "frontend"):  # the members' list itself, as dynamod's clients
        assert direct["units"][unit]["env"]["ETCD_ENDPOINTS"] == "{vars.etcd_url}"
    assert len(direct["vars"]["etcd_url"].split(",")) == 3


def test_a_stock_stack_without_the_expected_line_is_refused() -> None:
    stock = (paths.units_dir() / "stacks" / "cluster.toml").read_text()
    broken = stock.replace('    "--initial-cluster",', '    "--initial-cluster-x",')
    with pytest.raises(StackShapeError, match="initial-cluster"):
        replicated(broken, ["head", "n1", "n2"], paths.units_dir())


def _fake_inotify(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, limit: int) -> Path:
    knob = tmp_path / "max_user_instances"
    knob.write_text(f"{limit}\n")
    monkeypatch.setattr(fleet, "INOTIFY_LIMIT", knob)
    monkeypatch.setattr(fleet, "inotify_instances", lambda: (int(knob.read_text()), 10))
    return knob


def test_a_fleet_over_the_inotify_limit_is_refused_with_the_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    knob = _fake_inotify(monkeypatch, tmp_path, 128)
    refused = r"256 shards need 512 inotify instances.*at most 51"
    with pytest.raises(fleet.FleetError, match=refused), fleet.inotify_room(256, raise_limit=False):
        pass
    assert knob.read_text() == "128\n"  # nothing changed


def test_raise_inotify_raises_the_limit_for_the_run_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    knob = _fake_inotify(monkeypatch, tmp_path, 128)
    with (
        pytest.raises(RuntimeError, match="a fleet failed"),
        fleet.inotify_room(256, raise_limit=True) as facts,
    ):
        assert int(knob.read_text()) == facts["raised_to"] == 10 + 512 + 16
        assert fleet.shards_that_fit(int(knob.read_text()), 10) >= 256
        raise RuntimeError("a fleet failed")
    assert knob.read_text() == "128\n"  # back, even after a failure
    with fleet.inotify_room(40, raise_limit=True) as facts:  # fits: left alone
        assert facts["raised_to"] is None and knob.read_text() == "128\n"


def test_a_staggered_fleet_starts_the_etcd_members_together_then_one_node_at_a_time() -> None:
    names = ["head", "n1", "n2", "n3", "n4", "n5", "n6", "n7"]
    assert fleet.waves(names) == [["head", "n1", "n2"], ["n3"], ["n4"], ["n5"], ["n6"], ["n7"]]
    assert fleet.waves(["head", "n1"]) == [["head"], ["n1"]]  # below 3 nodes: the head's alone
    assert fleet.waves(["head"]) == [["head"]]


def test_max_starting_is_set_in_the_fleet_stack_s_own_table() -> None:
    stock = (paths.units_dir() / "stacks" / "cluster.toml").read_text()
    assert with_max_starting(stock, None) == stock
    text = replicated(with_max_starting(stock, 2), ["head", "n1", "n2"], paths.units_dir())
    stack = tomllib.loads(text)
    assert stack["stack"]["max_starting"] == 2 and stack["stack"]["name"] == "cluster"
    assert fleet.shard_settings({"shard_limits": {"nice": 10}, "max_starting": 2}) == (
        "nice 10, max_starting 2")
    with pytest.raises(StackShapeError, match=r"\[stack\]"):
        with_max_starting(stock.replace("[stack]\n", "[stack] \n"), 2)


def test_max_updating_is_set_in_the_fleet_stack_s_policy_table() -> None:
    stock = (paths.units_dir() / "stacks" / "cluster.toml").read_text()
    assert with_max_updating(stock, None) == stock
    text = replicated(with_max_updating(stock, 2), ["head", "n1", "n2"], paths.units_dir())
    stack = tomllib.loads(text)
    assert stack["policy"]["max_updating"] == 2 and stack["policy"]["shards"] == ["worker"]
    assert fleet.shard_settings({"max_starting": 2, "max_updating": 4}) == (
        "max_starting 2, max_updating 4")
    with pytest.raises(StackShapeError, match=r"\[policy\]"):
        with_max_updating(stock.replace("[policy]\n", "[policy] \n"), 2)


def test_fleet_history_sums_writes_by_kind_of_key() -> None:
    from bench import fleet_history

    assert fleet_history.key_class("dynamod/cluster/cluster/nodes/n1") == "cluster/nodes"
    assert fleet_history.key_class("dynamod/cluster/policy/current") == "policy/current"
    assert fleet_history.key_class("dynamod/cluster/policy/history/000000000002") == (
        "policy/history"
    )
    assert fleet_history.key_class("dynamod/cluster/shards/worker@3") == "shards"
    assert fleet_history.key_class("v1/instances/dynamod/backend/generate/1a") == (
        "dynamo instances"
    )
    assert fleet_history.key_class("dynamod/x") == "dynamod"
    assert fleet_history.key_class("") == "(empty)"
    totals: dict[str, dict[str, float]] = {}
    fleet_history.add_write(totals, "dynamod/s/cluster/nodes/n1", b"x" * 2048)
    fleet_history.add_write(totals, "dynamod/s/cluster/nodes/n2", b"x" * 1024)
    fleet_history.add_write(totals, "dynamod/s/shards/w", b"")  # a delete: the key only
    rows = fleet_history.by_class(totals)
    assert [r[0] for r in rows] == ["cluster/nodes", "shards"]
    key_bytes = len("dynamod/s/cluster/nodes/n1") * 2
    assert rows[0][1] == 2 and rows[0][2] == (3072 + key_bytes) / 1024
    assert fleet_history.summary_of(totals).startswith("cluster/nodes 3 KB (2), shards 0 KB (1)")


def test_thread_cpu_is_summed_by_name_and_what_ended_is_the_remainder() -> None:
    before = {(10, 10): ("python", 1.0), (10, 11): ("tokio-runtime-w", 2.0),
              (10, 12): ("tokio-runtime-w", 0.5), (20, 20): ("python", 3.0)}  # fmt: skip
    after = {(10, 10): ("python", 1.2), (10, 11): ("tokio-runtime-w", 2.3),
             (10, 13): ("tokio-runtime-w", 0.1),  # born in the window: from 0
             (20, 20): ("python", 3.4), (30, 30): ("python", 9.0)}  # fmt: skip
    # pid 10 used 1.0 s: 0.2 + 0.3 + 0.1 by its threads now, so 0.4 by threads that ended
    # (tid 12); pid 30 is not a process of the window
    got = by_thread(before, after, {10: 1.0, 20: 0.4})
    assert got["python"] == pytest.approx(0.6)
    assert got["tokio-runtime-w"] == pytest.approx(0.4)
    assert got[ENDED] == pytest.approx(0.4)
    assert sum(got.values()) == pytest.approx(1.4)


def test_thread_names_lose_their_digits() -> None:
    assert group("ZMQbg/IO/0") == "ZMQbg/IO/"
    assert group("tokio-runtime-w") == "tokio-runtime-w"
    assert group("42") == "42"


def test_threads_of_reads_this_process_s_threads() -> None:
    got = threads_of([os.getpid()])
    assert (os.getpid(), os.getpid()) in got
    assert all(secs >= 0 for _, secs in got.values())



def test_the_cut_says_what_the_cut_node_held() -> None:
    from bench.fleet import cut_node

    assert cut_node(None) == "-"
    assert cut_node({"node": "n7", "was_leader": False, "held_etcd_leader": False}) == "n7"
    held = {"node": "n1", "was_leader": True, "held_etcd_leader": True}
    assert cut_node(held) == "n1 (leader, etcd leader)"


def test_etcd_s_leader_is_read_from_its_metrics_line_alone() -> None:
    from bench.fleet_cut import _IS_LEADER

    metrics = "# HELP etcd_server_is_leader ...\n# TYPE etcd_server_is_leader gauge\n"
    assert _IS_LEADER.search(metrics + "etcd_server_is_leader 1\n")
    assert not _IS_LEADER.search(metrics + "etcd_server_is_leader 0\n")
    assert not _IS_LEADER.search("etcd_server_is_learner 1\netcd_server_is_leader 0\n")


def test_the_growth_picture_puts_each_value_on_the_linear_line_at_its_first_size(
    tmp_path: Path,
) -> None:
    """Scaled so a line's slope is its exponent: a value that doubles with the nodes stays
    on y = nodes, one measured from 2 nodes on starts at y = 2, one measured once is left
    out; a single node count draws nothing, and the redraw from a --json output says so."""
    import json
    import subprocess
    import sys

    from bench import fleet_plot

    def one(n: int, stall: float, cut: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes": n, "shards": 32 * n, "push": {"stall_s": stall}}
        if cut is not None:
            out["cut"] = {"rerouted_s": cut}
        return out

    fleets = [one(1, 0.5, None), one(2, 1.0, 1.5), one(4, 4.0, 1.5), one(8, 16.0, 1.5)]
    xs, ys, b = fleet_plot.series(fleets, ("push", "stall_s")) or ([], [], 0.0)
    assert xs == [1, 2, 4, 8] and ys == [1, 2, 8, 32] and b == pytest.approx(1.7)  # least squares
    xs, ys, b = fleet_plot.series(fleets, ("cut", "rerouted_s")) or ([], [], 1.0)
    assert xs == [2, 4, 8] and ys == [2, 2, 2] and b == pytest.approx(0.0)
    assert fleet_plot.series(fleets[:2], ("cut", "rerouted_s")) is None
    assert fleet_plot.draw(fleets[:1], tmp_path / "one.png") is None
    drawn = fleet_plot.draw(fleets, tmp_path / "growth.png")
    assert drawn is not None and drawn.read_bytes()[:4] == b"\x89PNG"
    saved = tmp_path / "fleet.json"
    saved.write_text(json.dumps({"data": {"fleets": fleets[:1]}}))
    cmd = [sys.executable, "-m", "bench.fleet_plot", str(saved), str(tmp_path / "again.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and "fewer than two node counts" in proc.stderr, proc.stderr
    saved.write_text(json.dumps({"data": {"fleets": fleets}}))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and (tmp_path / "again.png").is_file(), proc.stderr


def test_a_shard_s_push_by_step_is_each_step_s_median_over_the_shards_that_took_it() -> None:
    acks = [{"pause": 1.0, "load": 30.0, "route": 100.0},
            {"pause": 3.0, "load": 10.0, "route": 20.0},
            {"pause": 2.0, "load": 20.0}]  # fmt: skip  (a shard whose route was not waited)
    assert fleet.steps_median(acks) == {"pause": 2.0, "load": 20.0, "route": 60.0}
    assert list(fleet.steps_median(acks)) == ["pause", "load", "route"]
    assert fleet.steps_median([]) == {}


def test_the_step_table_has_a_column_per_step_and_a_dash_for_a_report_without_them() -> None:
    def one(nodes: int, steps: dict[str, float] | None) -> dict[str, Any]:
        push: dict[str, Any] = {"shard_median_ms": 50.0}
        if steps is not None:
            push["shard_steps_ms"] = steps
        return {"nodes": nodes, "shards": nodes * 32, "push": push}

    table = fleet.step_table(one(1, {"load": 10.0, "route": 30.0}),
                             [one(2, {"load": 12.0, "verify": 1.0}), one(8, None)])  # fmt: skip
    assert table.headers == ["nodes", "shards", "load", "route", "verify", "total (median)"]

    def cells(row: list[Any]) -> list[Any]:
        return ["-" if isinstance(v, float) and math.isnan(v) else v for v in row]

    assert cells(table.rows[0]) == [1, 32, 10.0, 30.0, "-", 50.0]
    assert cells(table.rows[1]) == [2, 64, 12.0, "-", 1.0, 50.0]
    assert cells(table.rows[2]) == [8, 256, "-", "-", "-", 50.0]
    assert "| 10.0 " in table.render()


def test_the_other_units_cpu_is_summed_by_unit_name_over_the_nodes() -> None:
    pids = [("etcd", 10), ("frontend", 11), ("etcd", 20), ("nats", 21)]
    used = {10: 1.0, 11: 2.5, 20: 0.5}  # nats's process is gone: it counts 0
    assert fleet.by_unit(pids, used) == {"etcd": 1.5, "frontend": 2.5, "nats": 0.0}


def test_the_push_cpu_table_splits_the_machine_s_busy_cpu_to_the_rest() -> None:
    def one(cpu_extra: dict[str, Any]) -> dict[str, Any]:
        cpu = {"busy_pct": 90.0, "busy_s": 10.0, "shards_s": 5.0, "daemons_s": 2.0, **cpu_extra}
        return {"nodes": 2, "shards": 8, "push": {"stall_s": 4.0, "cpu": cpu}}

    table = fleet.push_cpu_table(
        [one({"others_s": 2.5, "others_by_unit": {"etcd": 1.0, "frontend": 1.5}}), one({})]
    )
    others, rest = table.headers.index("other units' CPU s (largest)"), table.headers.index(
        "the rest s"
    )
    assert table.rows[0][others] == "2.50 (frontend 1.50)"
    assert table.rows[0][rest] == pytest.approx(0.5)
    assert math.isnan(table.rows[1][others]) and math.isnan(table.rows[1][rest])


def test_the_identity_table_names_its_rounds_and_compares_the_two_ways() -> None:
    look = {"rounds": 2, "looks": 5, "keys": 808, "daemons": {"whole": 8, "by_stack": 8},
            "whole": {"cpu_ms": 5.0, "etcd_ms": 5.5, "wall_ms": 11.0},
            "by_stack": {"cpu_ms": 1.5, "etcd_ms": 4.0, "wall_ms": 5.0}}  # fmt: skip
    table = fleet.identity_table([{"nodes": 1, "shards": 1}, {"nodes": 8, "shards": 256,
                                                              "identity": look}])  # fmt: skip
    assert "median of 2 rounds of 5 each way" in table.title
    (row,) = table.rows  # the fleet without the look (the 1 x 1 reference) has no row
    assert row[:3] == [8, 256, 808] and row[-2] == pytest.approx(0.3) and row[-1] == "8/8"


def test_the_early_push_repeated_is_judged_on_its_slowest_and_counted_against_2x() -> None:
    def early(stall: float, commit: float | None) -> dict[str, Any]:
        return {"stall_s": stall, "first_ack_ms": 80.0, "commit_ms": commit,
                "every_shard_s": 20.0}  # fmt: skip

    repeated = {"nodes": 8, "shards": 256, "early": early(0.10, 5.0),
                "early_again": [{**early(0.30, 47.0), "commit_cpu_ms": 2.5,
                                 "commit_waited_ms": 30.0}, early(0.12, None)]}  # fmt: skip
    once = {"nodes": 2, "shards": 64, "early": early(0.10, 5.0)}
    assert fleet.early_stalls(repeated) == [0.10, 0.30, 0.12]
    assert fleet.early_stalls(once) == [0.10] and fleet.early_stalls({"nodes": 1}) == []
    table = fleet.early_repeat_table([once, repeated], ref_s=0.1)
    (row,) = table.rows  # a fleet that pushed early once has no spread
    assert row[:4] == [8, 256, 3, "0.120 / 0.300"], row
    assert row[4] == "1.20 / 3.00" and row[5] == "2 of 3", row
    assert row[6:9] == ["80 / 80", "26.0 / 47.0", "20.0 / 20.0"], row  # None: left out
    assert row[9:] == ["5.0 (- / -; -; -), 47.0 (2.5 / 30.0; -; -), nan (- / -; -; -)",
                       "-"], row  # no etcd counts in these  # fmt: skip

    report = fleet.Report("fleet", "t", quick=False)
    reference = {"push": {"stall_s": 0.1}}
    full = {**repeated, "push": {"stall_s": 20.0, "shard_median_ms": 50.0},
            "status": {"max_s": 0.5}}  # fmt: skip
    fleet.judge_targets(report, reference, full, cut=[])
    slowest = [t for t in report.targets if "slowest of 3" in t["target"]]
    assert len(slowest) == 1 and slowest[0]["measured"] == pytest.approx(3.0), report.targets
    assert not slowest[0]["met"]

    # a reference that pushed early too: one shard's push is the median of its pushes
    ref = {"push": {"stall_s": 0.09}, "early": early(0.06, 2.0),
           "early_again": [early(0.07, 2.0), early(0.08, 2.0)]}  # fmt: skip
    assert fleet.one_shards_push(ref, full) == (
        pytest.approx(0.075), "the median stall of a 1 x 1 fleet's 4 pushes"
    )
    assert fleet.one_shards_push(reference, full)[0] == 0.1  # one push: its own stall


def test_etcd_s_slow_fsyncs_are_those_above_the_bucket_and_counted_per_member() -> None:
    def text(fsyncs: int, within: int, commits: int) -> str:
        wal, backend = DISK["wal_fsync"], DISK["backend_commit"]
        return "\n".join([
            f"# TYPE {wal} histogram",
            f'{wal}_bucket{{le="0.016"}} {within - 1}',
            f'{wal}_bucket{{le="{SLOW_LE}"}} {within}',
            f'{wal}_bucket{{le="+Inf"}} {fsyncs}',
            f"{wal}_sum 0.5", f"{wal}_count {fsyncs}",
            f'{backend}_bucket{{le="{SLOW_LE}"}} {commits}',
            f"{backend}_sum 0.1", f"{backend}_count {commits}",
            f"etcd_server_is_leader {int(fsyncs > 12)}",
        ])  # fmt: skip

    before = {"n1": disk_counts(text(10, 9, 4)), "n2": disk_counts(text(10, 10, 4))}
    assert before["n1"]["wal_fsync_slow"] == 1 and before["n1"]["backend_commit_slow"] == 0
    after = {"n1": disk_counts(text(13, 10, 6)), "n2": disk_counts(text(12, 12, 5))}
    since = disk_since(before, after)
    assert since["n1"]["wal_fsync_count"] == 3 and since["n1"]["wal_fsync_slow"] == 2
    assert since["n2"]["wal_fsync_slow"] == 0 and since["n2"]["backend_commit_count"] == 1
    assert slow_disk({"etcd_disk": since}) == "2 / 0"
    assert (since["n1"]["is_leader"], since["n2"]["is_leader"]) == (1, 0)  # as it is after
    assert raft_leader({"etcd_disk": since}) == "n1"
    assert math.isnan(disk_counts("")["wal_fsync_slow"])  # a member without the metric


def test_etcd_s_slowest_txn_is_the_first_bound_that_holds_every_member_s_txns() -> None:
    def text(within: dict[str, int], count: int) -> str:
        def line(method: str, le: str, n: int) -> str:
            return (f'{TXN}{{grpc_method="{method}",grpc_service="etcdserverpb.KV",'
                    f'grpc_type="unary",le="{le}"}} {n}')  # fmt: skip

        lines = [line("Txn", le, n) for le, n in within.items()]
        # another method is not counted
        return "\n".join([f"# TYPE {TXN[:-len('_bucket')]} histogram", *lines,
                          line("Txn", "+Inf", count), line("Range", "0.005", 0),
                          line("Range", "+Inf", 50)])  # fmt: skip

    quick = {"0.005": 8, "0.01": 10, "0.025": 10, "0.05": 10}
    before = {"n1": disk_counts(text(quick, 10)), "n2": disk_counts(text(quick, 10))}
    assert before["n1"]["txn_count"] == 10 and before["n1"]["txn_le_0.005"] == 8
    # n1 served 3 more within 5 ms; n2 one more, taking 25-50 ms: the slowest is n2's
    after = {"n1": disk_counts(text({**quick, "0.005": 11, "0.01": 13, "0.025": 13,
                                     "0.05": 13}, 13)),
             "n2": disk_counts(text({**quick, "0.05": 11}, 11))}  # fmt: skip
    assert slowest_txn({"etcd_disk": disk_since(before, after)}) == "<= 50 ms"
    after["n2"] = disk_counts(text(quick, 10))  # n2 served none
    assert slowest_txn({"etcd_disk": disk_since(before, after)}) == "<= 5 ms"
    after["n2"] = disk_counts(text(quick, 12))  # two beyond every bound read
    assert slowest_txn({"etcd_disk": disk_since(before, after)}) == "> 1000 ms"
    assert slowest_txn({"etcd_disk": {"n1": disk_counts("")}}) == "-"  # basic metrics
    assert slowest_txn({}) == "-"


def test_the_early_push_s_load_keeps_its_failures_by_kind() -> None:
    from bench.fleet_early import ERROR_CHARS, latencies
    from dynamod.chaos.history import Request

    def row(status: int, error: str | None = None, latency: float = 0.04) -> Request:
        return Request(sent=1.0, done=1.0 + latency, status=status, error=error)

    long = "no instances " + "x" * 300
    rows = [row(200), row(200, latency=0.08), row(503, long), row(503, long),
            row(-1, "ServerDisconnectedError()")]  # fmt: skip
    found = latencies(rows)
    assert (found["requests"], found["failed"]) == (5, 3)
    assert found["p50_ms"] == pytest.approx(60.0)
    kinds = found["failures"]
    assert kinds == {f"503: {long[:ERROR_CHARS]}": 2,
                     "-1: ServerDisconnectedError()": 1}  # fmt: skip
    assert latencies(rows[:2])["failures"] == {}
