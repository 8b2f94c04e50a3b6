"""Every benchmark's quick profile (bench/run_all.py's BENCHMARKS), so a benchmark that
breaks fails the suite: `--quick --json` exits 0 and prints the documented result shape.
Missed targets are results, not failures, so only the shape is checked here;
docs/benchmarks.md holds the numbers. A benchmark that fails says so in one line and a
non-zero exit status, never a traceback."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import fleet_sched, procs
from bench.goodput import QUICK_RUN_S
from bench.run_all import BENCHMARKS
from dynamod.core import cgroups
from tests.conftest import ROOT, extra_venv

pytestmark = pytest.mark.slow

# One simulated cluster at a time: the netns tests' group (make test runs -n 2).
GROUPS = {"cluster": "netns", "fleet": "netns", "publish_nodes": "netns"}
# Left out of CI, each with why (`make bench` runs them).
NOT_IN_CI = {
    # its quick profile starts a real dynamo.vllm shard twice (minutes, ~4 GB); the
    # real engine's behaviour is CI's in tests/integration/test_real_engine.py
    "real_engine",
}


def run_bench(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def check_shape(result: dict[str, Any], name: str, extra: tuple[str, ...] = ()) -> None:
    assert result["benchmark"] == name
    assert result["quick"] is True
    assert isinstance(result["title"], str) and result["title"]
    assert result["machine"]["cores"] >= 1
    assert result["command"].endswith(" ".join([f"bench.{name} --quick --json", *extra]))
    assert result["tables"], "a benchmark prints at least one table"
    for table in result["tables"]:
        assert table["title"] and table["headers"]
        assert table["rows"], f"table {table['title']!r} is empty; notes: {result.get('notes')}"
        for row in table["rows"]:
            assert len(row) == len(table["headers"]), (table["title"], row)
    assert isinstance(result["targets"], list)  # some benchmarks judge none (tables only)
    for target in result["targets"]:
        assert set(target) == {"target", "measured", "limit", "unit", "met"}
        assert isinstance(target["met"], bool)
        if target["measured"] is None:
            # never reached in the run (NaN in the tables, null in JSON): a missed target,
            # reported as one; the scenario's own check says whether it ran at all
            assert target["met"] is False, target
            continue
        assert isinstance(target["measured"], int | float), target
        assert math.isfinite(target["measured"]), target
    if result["targets"]:  # a benchmark that judges measures something
        assert any(t["measured"] is not None for t in result["targets"]), result["targets"]


def check_detect(result: dict[str, Any]) -> None:
    rows = {row[0]: row for row in result["tables"][0]["rows"]}
    assert any(label.startswith("supervisord") for label in rows)
    floors = [row for label, row in rows.items() if label.startswith("floor")]
    # quick: the stack alone (the crowd only in the full run)
    assert len(floors) == 1 and all(row[1] == 5 and 0 < row[2] < 1000 for row in floors)
    assert result["data"]["summary"]["dynamod"]["n"] >= 5
    split = next(t for t in result["tables"] if t["title"].startswith("The same kills"))
    assert len(split["rows"]) == 4
    for key, run in result["data"]["runs"].items():
        # every kill split in two at the reference clock, the parts adding up
        assert len(run["exit_ms"]) == len(run["share_ms"]) == len(run["log_ms"]), key
        for whole, kernel, share in zip(
            run["log_ms"], run["exit_ms"], run["share_ms"], strict=True
        ):
            assert kernel > 0, (key, kernel)  # the exit completes after the kill
            assert math.isclose(kernel + share, whole, abs_tol=1e-6), key


def check_down(result: dict[str, Any]) -> None:
    survivors = [row for row in result["tables"][0]["rows"] if row[1] == "dynamod"]
    assert survivors and all(row[8] == 0 for row in survivors)


def check_policy_push(result: dict[str, Any]) -> None:
    # the model built at ~10 MB, pushed into a stack serving it: every shard acked
    sizes = {w["mb"] for w in result["data"]["weights"]}
    assert len(sizes) == 1 and 9 < min(sizes) < 11, sizes
    assert {p["mb"] for p in result["data"]["pushes"]} == sizes
    assert {r["mb"] for r in result["data"]["replays"]} == sizes
    for p in result["data"]["pushes"]:
        assert len(p["shard_total_ms"]) == p["shards"] == 2, p
        assert p["slowest_ms"]["load"] > 0, p


def check_publish_scale(result: dict[str, Any]) -> None:
    # the real colocated path into 1 and 2 shards hosting the extension: every timed update
    # and push reached every shard, and the stall's parts are the trainer's own measurements
    stacks = result["data"]["stacks"]
    assert [s["shards"] for s in stacks] == [1, 2], stacks
    for s in stacks:
        assert len(s["updates"]) == len(s["pushes"]) == 2, s
        for u in s["updates"]:
            assert u["acked"] == s["shards"] and u["send_s"] > 0 and u["publish_s"] > 0, u
            assert u["send_s"] + u["publish_s"] < u["stall_s"], u
            assert u["slowest_ms"]["verify"] > 0 and u["slowest_ms"]["route"] > 0, u
        assert all(p["acked"] == s["shards"] and p["daemon_s"] > 0 for p in s["pushes"]), s
        # the CPU of the timed updates, put to the trainer (this process), shards, daemon...
        cpu = s["cpu"]
        assert cpu["busy_ms"] > 0 and 0 < cpu["busy_pct"] <= 100.5, cpu
        assert cpu["parts_ms"]["trainer"] > 0 and cpu["parts_ms"]["shards"] > 0, cpu
        # torch in every shard (the receiver): more than a plain CPU worker's ~50 MB
        assert s["shard_pss_mb"] and min(s["shard_pss_mb"]) > 100, s
    (target,) = result["targets"]
    assert target["limit"] == 2.0 and target["measured"] > 0, target


def check_publish_nodes(result: dict[str, Any]) -> None:
    # the colocated path on 1 and 2 network-namespace nodes, a rank a node: every timed
    # update reached every node's shard, n1's with no load, and every push reached both
    clusters = result["data"]["clusters"]
    assert [(c["nodes"], c["shards"]) for c in clusters] == [(1, 1), (2, 2)], clusters
    for c in clusters:
        assert len(c["updates"]) == len(c["pushes_s"]) == 2, c
        for u in c["updates"]:
            assert u["acked"] == c["shards"] and u["send_s"] > 0, u
            assert 0 < u["publish_s"] < u["stall_s"] and u["head_slowest_ms"] > 0, u
        assert all(p > 0 for p in c["pushes_s"]) and 0 < c["busy_pct"] <= 100.5, c
    one, two = clusters
    assert one["follow"]["shards"] == 0, one["follow"]
    assert [u["other_nodes_shards"] for u in one["updates"]] == [0, 0]
    follow = two["follow"]
    assert follow["shards"] == 1 and follow["loads"] == 0 and follow["slowest_ms"] > 0, follow
    assert [u["other_nodes_shards"] for u in two["updates"]] == [1, 1]
    (target,) = result["targets"]
    assert target["limit"] == 2.0 and target["measured"] > 0, target


def check_outages(result: dict[str, Any]) -> None:
    # a scenario that crashed is only a note there: here it fails the smoke run
    assert not [n for n in result["notes"] if "did not complete" in n], result["notes"]
    assert result["data"]["kill9_push"] and result["data"]["frontend_hang"] == {}  # full only
    # the quick etcd cut ran (on kill9_push's stack), with the stock Dynamo lease
    (cut,) = result["data"]["etcd_cut"].values()
    assert cut["cut_s"] > 0 and cut["requests_during"] > 0, cut


def check_goodput(result: dict[str, Any]) -> None:
    # AIPerf's records and its summary agree, the kill landed mid-run, the stack served after
    (run,) = result["data"]["runs"]
    assert run["supervisor"] == "dynamod" and run["fault"] == "worker_kill", run
    # (AIPerf's request_count counts the requests that succeeded)
    assert run["records"] > 0 and run["records"] == run["requests"] + run["failed"], run
    assert run["failed"] == run["aiperf_errors"], run
    # mid-run: at its time (3 s) or late on a loaded machine, with 2 s of the run after it
    assert not run["fault_error"] and 2 < run["fault_at_s"] < QUICK_RUN_S - 2, run
    assert run["reference"]["goodput_rps"] > 0 and run["served_after"], run
    assert run["recovery_s"] is None or 0 <= run["recovery_s"] < 8, run
    # the windows its picture draws (bench.goodput_plot): the whole run, good requests in them
    windows = run["goodput_windows"]
    assert len(windows["rps"]) == int((QUICK_RUN_S - windows["window_s"]) / windows["step_s"]) + 1
    assert max(windows["rps"]) > 0, windows
    # the host while it sent (bench.host): the machine was busy serving it
    assert run["host"]["busy_s"] > 0 and run["host"]["steal_s"] >= 0, run["host"]


def check_fleet(result: dict[str, Any]) -> None:
    # 2 nodes x 4 shards: the push reached all 8, each node's status saw both nodes, the
    # cut ran under load and its node's shards left the router
    (fleet,) = result["data"]["fleets"]
    assert fleet["nodes"] == 2 and fleet["push"]["acked"] == 8, fleet["push"]
    assert fleet["up_cpu"]["host"]["busy_s"] > 0, fleet["up_cpu"]  # 8 shards started
    assert set(fleet["status"]["nodes_seen"].values()) == {2}, fleet["status"]
    assert fleet["cut"]["requests"] > 0 and fleet["cut"]["rerouted_s"] > 0, fleet["cut"]
    assert fleet["push"]["etcd_after"]["keys"] > 0, fleet["push"]
    # a shard's push by step, and the CPU of the stack's other units (each node's etcd
    # member, relay, NATS; the head's frontend) in it
    steps = fleet["push"]["shard_steps_ms"]
    assert {"load", "verify", "route"} <= set(steps) and all(v >= 0 for v in steps.values()), steps
    others = fleet["push"]["cpu"]["others_by_unit"]
    assert {"etcd", "nats", "frontend"} <= set(others), others
    # --profile: both nodes' daemons and a shard of each sampled through the push, their
    # samples kept
    profile = fleet["push"]["profile"]
    assert sorted(profile) == ["head", "head/worker@0", "n1", "n1/worker@3"], profile
    assert all(Path(p["file"]).exists() and p["rate"] > 0 for p in profile.values()), profile
    assert sum(p["samples"] for p in profile.values()) > 0, profile
    # the second push answered once 1 of the head's 4 shards served it, the fleet after
    early = fleet["early"]
    assert early["acked_at_answer"] + early["updating_at_answer"] == 4, early
    assert early["acked_at_answer"] >= 1 and not early["behind"] and not early["stale"], early
    assert early["every_shard_s"] >= early["stall_s"] * 0.5, early
    # the machine's CPU in its stall, put to the fleet's parts (no shard by its own name)
    split = early["cpu_split"]["parts"]
    assert set(split) & {"first shard", "head's other shards", "head's daemon",
                         "bench (load, the call)"}
    assert not any(part.startswith("worker@") for part in split), split
    assert early["cpu_split"]["window_s"] >= early["stall_s"], early["cpu_split"]
    assert early["first_shard"].startswith("worker@"), early  # the head's, by its unit name
    if fleet["sched_trace"]:  # behind whom its threads waited: every ms of it put somewhere
        traced = early["cpu_split"]["behind"]
        first = traced["first shard"]
        assert traced["events"] > 0 and first["waits"] > 0, traced
        assert 0.9 * first["waited_ms"] <= sum(first["behind_ms"].values()) <= (
            first["waited_ms"] * 1.001 + 0.001), first  # fmt: skip
        assert "head's daemon" in traced, traced
    # under load: the new step's requests from the answer on were served, at that step
    step = early["load"]["step_all"]
    assert step["requests"] > 0 and step["failed"] == 0, early["load"]
    assert early["load"]["step_wrong_version"] == 0, early["load"]
    # the identity's look both ways on the fleet's etcd: the same daemons found, both nodes'
    look = fleet["identity"]
    assert look["same"] and look["daemons"] == {"whole": 2, "by_stack": 2}, look
    assert look["keys"] > 0 and look["by_stack"]["cpu_ms"] > 0, look
    # the control plane's health, read from the daemons' logs: the cut node marked lost
    assert fleet["cut"]["node"] in fleet["health"]["marked_lost"], fleet["health"]
    # lost by the leader's heartbeats, or (the race's other side) its lease's expiry
    assert "heartbeat" in fleet["cut"]["why"] or "lease expired" in fleet["cut"]["why"], fleet


def check_shm_note(result: dict[str, Any]) -> None:
    # every way found the unit's 4 processes (its main and 3 children) and its one file
    # (the benchmark refuses a note that found another), each part timed
    rows = result["data"]["rows"]
    assert {r["way"] for r in rows} >= {"process group"}, rows
    base, _ = cgroups.own_cgroup_dir()
    if base is not None and os.access(base, os.W_OK):  # where dynamod would use cgroups
        assert {r["way"] for r in rows} == {"cgroup", "process group"}, rows
    for row in rows:
        assert row["processes"] == 4 and row["maps_lines"] > 0, row
        assert all(ms > 0 for ms in row["note_ms"] + row["read_ms"]), row
        # the group through dynamod's tree, beside the pass over /proc that found the same
        assert ("whole_proc_ms" in row) == (row["way"] == "process group"), row
        assert row["tree_processes"] >= row["processes"], row


CHECKS = {
    "detect": check_detect,
    "down": check_down,
    "policy_push": check_policy_push,
    "publish_scale": check_publish_scale,
    "publish_nodes": check_publish_nodes,
    "outages": check_outages,
    "goodput": check_goodput,
    "fleet": check_fleet,
    "shm_note": check_shm_note,
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.xdist_group(GROUPS[n])] if n in GROUPS else [])
        for n in BENCHMARKS
        if n not in NOT_IN_CI
    ],
)
def test_quick_json(name: str, tmp_path: Path) -> None:
    if name == "goodput":  # AIPerf's venv: `make test` builds it beside the suite
        extra_venv(".venv-aiperf", "aiperf")
    # the fleet's daemons sampled through its push (py-spy): the profile's whole path; and
    # the scheduler traced over its early push where this machine lets it (root, tracefs)
    extra: tuple[str, ...] = ()
    if name == "fleet":
        extra = ("--profile", str(tmp_path / "profile"))
        extra += ("--sched-trace",) if fleet_sched.missing() is None else ()
    proc = run_bench(f"bench.{name}", "--quick", "--json", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    check_shape(result, name, extra)
    if name in CHECKS:
        CHECKS[name](result)


def one_failure_line(proc: Any, status: int) -> str:
    assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "a failure says what failed"
    return str(lines[-1])


def test_a_failed_benchmark_says_so_in_one_line(tmp_path: Path) -> None:
    """A real fault: dynamod's cache dir cannot be created (XDG_CACHE_HOME is a file),
    so the benchmark cannot build its model; alone and under run_all."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {"XDG_CACHE_HOME": str(blocker)}
    proc = run_bench("bench.policy_push", "--quick", "--json", env=env, timeout=120)
    line = one_failure_line(proc, 1)
    assert line.startswith("python -m bench.policy_push: failed: "), line
    assert str(blocker) in line, line
    assert proc.stdout == ""
    assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1, proc.stderr

    proc = run_bench("bench.run_all", "--quick", "--only", "policy_push", env=env, timeout=120)
    line = one_failure_line(proc, 1)
    assert line.startswith("python -m bench.run_all: failed: 1 of 1 benchmarks: policy_push"), line
    assert "python -m bench.policy_push: failed: " in line, line



def _fleet_processes() -> tuple[set[int], set[int]]:
    """(the simulated fleet's dynamod processes and everything below them, its shards): a
    fleet's dynamod keeps its state in a /tmp/dmc* work dir (ClusterRig's); the netns
    group runs one fleet at a time."""
    argvs: dict[int, list[bytes]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            argvs[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
    roots = {
        pid for pid, argv in argvs.items()
        if b"dynamod" in argv and b"--state-dir" in argv[:-1]
        and argv[argv.index(b"--state-dir") + 1].startswith(b"/tmp/dmc")
    }  # fmt: skip
    ours = roots | {pid for root in roots for pid in procs.descendants(root)}
    shards = {pid for pid in ours if b"dynamod.workers.cpu" in argvs.get(pid, [])}
    return ours, shards


@pytest.mark.xdist_group("netns")
def test_a_fleet_stopped_by_sigterm_stops_its_daemons_and_namespaces() -> None:
    """SIGTERM to bench.fleet mid-run (an operator's `kill`, a CI timeout): its fleet's
    daemons and units end and its namespaces go, as at a normal end. Before, the signal's
    default action left the fleet running, its namespaces and a raised inotify limit."""
    from dynamod.chaos.netns import can_create_namespaces

    if (reason := can_create_namespaces()) is not None:
        pytest.skip(reason)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fleet", "--quick", "--json"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        ours: set[int] = set()
        shards: set[int] = set()
        while len(shards) < 8:  # both nodes' shards started: the fleet is up
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, (ours, shards)
            time.sleep(0.2)
            ours, shards = _fleet_processes()
        proc.send_signal(signal.SIGTERM)
        _, said = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 128 + signal.SIGTERM, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert [pid for pid in ours if procs.alive(pid)] == [], said[-3000:]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dmc{proc.pid}x" not in names, names
    # the stopped fleet's logs are kept and named, as a failed one's: removed here
    kept = re.search(r"# fleet: 2 nodes did not finish; logs in (/tmp/dmc\S+)", said)
    assert kept is not None, said[-3000:]
    assert (Path(kept[1]) / "head" / "daemon.log").exists(), kept[1]
    shutil.rmtree(kept[1])
