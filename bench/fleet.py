"""Benchmark - fleet: dynamod's control plane over a simulated fleet, and how it grows.

    python -m bench.fleet [--quick] [--json] [--nodes 1,2,4,8] [--shards-per-node S]
                          [--raise-inotify] [--no-faults] [--max-starting N]
                          [--max-updating N] [--modeled-reset S] [--profile DIR] [--png PATH]
                          [--early-pushes N] [--direct-etcd] [--sched-trace]

Network namespaces as nodes (root needed; dynamod.chaos.cluster.ClusterRig), one dynamod
daemon per node, units/stacks/cluster.toml with etcd as 3 members on the first 3 nodes from 3
nodes on (bench/fleet_stack.py), NATS, the frontend and the trainer on the head, S rollout
shards on every node. A shard is our CPU worker with its mocker engine
(random tokens, `--var worker_engine=mocker`): a light process that registers with Dynamo's
runtime, speaks the engine routes dynamod's policy layer drives (pause, update weights,
flush, resume) and is a unit its node's dynamod supervises. First a 1-node x 1-shard fleet
(the reference push), then each node count of `--nodes`, a fresh fleet each. Per fleet:
the idle cost (each shard's and each daemon's CPU and memory), a push to every shard (the
daemon's total, the trainer's stall: the wall time of its blocking push call; then until
every shard is routed again, the ones the push cost restarted and replayed), `dynamod
status --json` on every node (its CLI wall time, the daemon's answer alone), etcd's keys,
watchers and writes around the push and its reads and writes per second idle; on 2+ nodes,
under load from inside the head, kill -9 of 10 % of the shards at once (until they serve
again, requests failed) and one node's link cut (bench.cluster's round without its push and
rejoin: until the router drops its shards, requests lost after that). Then each value's
growth exponent over the node counts (1: linear), those above 1.25 named. A fleet larger
than the kernel's inotify instances hold (2 per shard) is refused up front, with the numbers;
`--raise-inotify` (root) raises fs.inotify.max_user_instances to what the fleet needs for the
run and puts the old value back at its end (the issue's 8 x 32 needs 528 against a default 128).
`--modeled-reset S` keeps every shard's engine through its reset and waits S s off the
CPU instead, as an accelerator's in-place copy would: the push's other work stays real, so
the run splits the full push between the shards' engine builds on the shared cores and the
rest. Quick (CI): 2 nodes x 4 shards, one push, one status, one node cut with 1 s of load either
side (the reference: the head's median shard's own time in the same push).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from bench import fleet_history, fleet_plot, fleet_profile, fleet_sched, host
from bench.fleet_cpu import behind_table, daemon_pid, pids_of, split_table
from bench.fleet_cut import cut_one, cut_target, member_metrics
from bench.fleet_early import (
    early_repeat_table,
    early_stalls,
    early_table,
    push_early,
    push_early_again,
    pushes_of,
)
from bench.fleet_growth import (
    ETCD_METRICS,
    GROWTH,
    INOTIFY_PER_SHARD,
    INOTIFY_RESERVE,
    SizesError,
    exponent,
    faster_than_linear,
    history_kb,
    parse_sizes,
    pick,
    prometheus,
    shards_that_fit,
    writes,
)
from bench.fleet_identity import identity_look
from bench.fleet_scan import exposure_scan
from bench.fleet_stack import (
    members,
    replicated,
    with_etcd_metrics,
    with_heartbeat,
    with_lease,
    with_max_starting,
    with_max_updating,
    with_modeled_reset,
    with_shard_limits,
    with_shard_live_timeout,
)
from bench.fleet_threads import by_thread, thread_table, threads_of
from bench.procs import cpu_of, cpu_since, exit_on_signals, iso_epoch, pss_mb, rss_mb
from bench.report import Report, Table, emit, entry, options
from dynamod.chaos.cluster import NODE_NAMES, ClusterError, ClusterRig
from dynamod.chaos.model import Load
from dynamod.chaos.netns import can_create_namespaces
from dynamod.chaos.node_loss import lost_by, make_checkpoint
from dynamod.client import Client
from dynamod.core import paths
from dynamod.core.errors import DynamodError
from dynamod.rollout.dynamo import metric_samples
from dynamod.workers.cpu.args import MODELED_RESET_MAX_S

STACK = paths.units_dir() / "stacks" / "cluster.toml"
MACHINE_GIB = 24  # what the fleet has to fit in
IDLE_S = 5.0  # the idle window
EARLY_STEP = 2  # the second push's step (the first's is 1): answered early, `--serving 1`
EARLY_PUSHES_MAX = 20  # `--early-pushes`: each is a push to every shard (~20 s at 8 x 32)
LOAD = Load(clients=3, rate=6, trainer_fraction=0.5, max_tokens=4, request_timeout=10)


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,4,8", help="node counts, rising (up to 8)")
    parser.add_argument(
        "--shards-per-node", type=int, default=6, help="shards on every node (default 6)"
    )
    parser.add_argument(
        "--raise-inotify",
        action="store_true",
        help="raise fs.inotify.max_user_instances for the run if the fleet needs it (root); "
        "the old value is put back at the end",
    )
    parser.add_argument(
        "--no-faults",
        action="store_true",
        help="skip the kill -9 of 10 %% and the node cut: start, idle, push, status only",
    )
    parser.add_argument(
        "--lease",
        type=int,
        default=None,
        help="the registry lease, whole s (default: the stack's; 1 also shortens etcd's "
        "election timeout, which etcd needs to grant it)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="the leader's heartbeat timeout, s (cluster.heartbeat_timeout; default: the "
        "stack's, 1.2; 0 turns the heartbeats off, leaving a cut node to its lease)",
    )
    parser.add_argument(
        "--cut-leader",
        action="store_const",
        dest="cut",
        const="leader",
        default="last",
        help="cut the node that holds the cluster's leader key (heard by the deputy alone) "
        "instead of the last node; the last all the same when the head leads",
    )
    parser.add_argument(
        "--cut-etcd-leader",
        action="store_const",
        dest="cut",
        const="etcd-leader",
        help="cut the node whose etcd member leads etcd's raft (moved off the head first): "
        "etcd then elects a leader, and no revocation is written before it has (3 nodes or "
        "more)",
    )
    parser.add_argument(
        "--shard-cpu-weight",
        type=int,
        default=None,
        help="give every shard `limits = { cpu_weight = N }` (1-10000; 100 is the default "
        "share), to let etcd, NATS and the daemons go first; on cgroup v1 it starved the "
        "shards' own start instead (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--shard-nice",
        type=int,
        default=None,
        help="give every shard `limits = { nice = N }` (1-19): each shard (its processes "
        "and its session) yields the CPU to etcd, NATS, the frontend and the daemons when "
        "the cores are short (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--shard-live-timeout",
        type=float,
        default=None,
        help="seconds each shard's liveness probe may take to answer (the stack's: 2). A "
        "node of the fleet is 32 shards on the machine's cores where a real node gives each "
        "its own; at 8 x 32 on two cores shards missed 2 s and 20 s probes alike during a "
        "push to every shard (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--max-starting",
        type=int,
        default=None,
        help="set `[stack] max_starting = N`: each node's daemon starts at most N of its "
        "units at once, the rest wait their turn before the spawn (docs/stack-files.md); "
        "without it all 256 shards of 8 x 32 starting at once on two cores missed their "
        "readiness deadlines for good (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--max-updating",
        type=int,
        default=None,
        help="set `[policy] max_updating = N`: each node's daemon lets at most N of its "
        "shards apply an update at once, the rest wait their turn still serving "
        "(docs/stack-files.md); without it 256 shards updating at once on two cores failed "
        "their liveness probes inside the push (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--modeled-reset",
        type=float,
        default=None,
        metavar="S",
        help="every shard's engine reset (its update, a flush) keeps its engine and waits S "
        "s off the CPU, as an accelerator's in-place copy would, instead of building a new "
        "engine on two shared cores (the CPU worker's --modeled-reset-s); the 1 x 1 "
        "reference too. Everything else a push does is real (docs/benchmarks.md 16)",
    )
    parser.add_argument(
        "--staggered",
        action="store_true",
        help="start the nodes that hold etcd's members together, then every other node on "
        "its own once the ones before are up: each node's shards start on the machine's "
        "cores as they would on a node's own, not all 256 at once on two (docs/benchmarks.md "
        "16); `up s` is then the sum, and each wave's time is in the JSON",
    )
    parser.add_argument(
        "--early-pushes",
        type=int,
        default=1,
        metavar="N",
        help="push answered early (`--serving 1`) N times in each fleet, one after another "
        "once every shard is routed again (default 1): the stall's and the commit's spread "
        "over N, and a target on the slowest; the faults then use the last step",
    )
    parser.add_argument(
        "--direct-etcd",
        action="store_true",
        help="give Dynamo's processes (the shards', the frontend) etcd's members' list, not "
        "their node's etcd relay: what the relay's hop costs where no member fails "
        "(units/cluster/etcd-relay.toml says why the stock stack has it)",
    )
    parser.add_argument(
        "--sched-trace",
        action="store_true",
        help="record the scheduler's events (tracefs; root) over each push answered early, "
        "and say behind whom the answer's shard's and the head's daemon's threads waited for "
        "a core: their own threads, the head's other parts, the other nodes' (bench.fleet_sched)",
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=IDLE_S,
        help=f"seconds of the idle window (default {IDLE_S:g}; 1 in --quick): each shard's "
        "and daemon's CPU, etcd's reads and writes by kind of key, and how fast etcd's kept "
        "history grows (an idle fleet writes nothing: a longer window shows a regression)",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        metavar="PATH",
        help="also draw the growth with the node count (log-log, slope = exponent) into "
        "PATH (bench.fleet_plot, which also redraws it from a --json output)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        default=None,
        help="sample the head's daemon and the last node's, and a shard of each, with py-spy "
        "through the push; a table of their CPU by task, the samples kept in DIR",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each fleet's work dir (the daemons' and units' logs) after a clean run "
        "too; its path is printed on stderr",
    )
    args = parser.parse_args()
    try:
        nodes = [2] if args.quick else parse_sizes(args.nodes, len(NODE_NAMES))
        per_node = 4 if args.quick else parse_sizes(str(args.shards_per_node), 64)[0]
    except SizesError as exc:
        parser.error(str(exc))
    if args.lease is not None and args.lease < 1:
        parser.error(f"--lease: whole seconds of at least 1, got {args.lease}")
    beat = args.heartbeat_timeout
    if beat is not None and not (beat == 0 or 0.6 <= beat <= 60):
        parser.error(f"--heartbeat-timeout: 0 (off) or seconds from 0.6 to 60, got {beat:g}")
    weight = args.shard_cpu_weight
    if weight is not None and not 1 <= weight <= 10000:
        parser.error(f"--shard-cpu-weight: 1 to 10000, got {weight}")
    if args.shard_nice is not None and not 1 <= args.shard_nice <= 19:
        parser.error(f"--shard-nice: 1 to 19, got {args.shard_nice}")
    live_timeout = args.shard_live_timeout
    if live_timeout is not None and not 0 < live_timeout <= 300:
        parser.error(f"--shard-live-timeout: seconds above 0 and at most 300, got {live_timeout}")
    if args.max_starting is not None and not 1 <= args.max_starting <= 256:
        parser.error(f"--max-starting: 1 to 256, got {args.max_starting}")
    if args.max_updating is not None and not 1 <= args.max_updating <= 256:
        parser.error(f"--max-updating: 1 to 256, got {args.max_updating}")
    modeled = args.modeled_reset
    if modeled is not None and not 0 <= modeled <= MODELED_RESET_MAX_S:
        parser.error(f"--modeled-reset: seconds from 0 to {MODELED_RESET_MAX_S:g}, got {modeled:g}")
    if not 1 <= args.early_pushes <= EARLY_PUSHES_MAX:
        parser.error(f"--early-pushes: 1 to {EARLY_PUSHES_MAX}, got {args.early_pushes}")
    if not 1 <= args.idle <= 3600:
        parser.error(f"--idle: seconds from 1 to 3600, got {args.idle:g}")
    if args.profile is not None and (why := fleet_profile.missing()) is not None:
        parser.error(why)
    if args.sched_trace and (why := fleet_sched.missing()) is not None:
        parser.error(f"--sched-trace: {why}")
    limits = {"cpu_weight": weight, "nice": args.shard_nice}
    shard_limits = {name: value for name, value in limits.items() if value is not None}
    exit_on_signals()  # a stopped run stops its fleet and puts the inotify limit back
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    report = Report("fleet", "The fleet, simulated: control-plane cost by node count", args.quick)
    reason = can_create_namespaces()
    if reason is not None:
        report.notes.append(f"not run: {reason}")
        emit(report, args.json)
        return
    with inotify_room(nodes[-1] * per_node, raise_limit=args.raise_inotify) as inotify:
        lease = args.lease
        reference = (
            None
            if args.quick
            else run_fleet(1, 1, quick=True, faults=False, lease=lease, limits=shard_limits,
                           live_timeout=live_timeout, max_starting=args.max_starting,
                           max_updating=args.max_updating, heartbeat_timeout=beat,
                           modeled_reset=modeled, early_pushes=args.early_pushes,
                           sched_trace=args.sched_trace)
        )
        fleets = []
        for n in nodes:
            faults = n > 1 and not args.no_faults
            fleets.append(
                run_fleet(
                    n, per_node, quick=args.quick, faults=faults, lease=lease, limits=shard_limits,
                    keep=args.keep, staggered=args.staggered, live_timeout=live_timeout,
                    max_starting=args.max_starting, max_updating=args.max_updating,
                    idle_s=args.idle, heartbeat_timeout=beat, cut=args.cut,
                    profile=args.profile, modeled_reset=modeled,
                    early_pushes=args.early_pushes, direct_etcd=args.direct_etcd,
                    sched_trace=args.sched_trace,
                )
            )
            # kept on stderr as it comes: a later fleet that fails does not lose this one
            print(f"# fleet done: {json.dumps(fleets[-1], default=str)}", file=sys.stderr)
    judge(report, reference, fleets)
    report.data["inotify"] = inotify
    if args.direct_etcd:
        report.notes.append("Dynamo's processes reached etcd's members directly (--direct-etcd), "
                            "not through their node's etcd relay")  # fmt: skip
    if modeled is not None:
        report.notes.append(
            f"every shard's engine reset (its update, a flush) was modeled: its engine kept, "
            f"{modeled:g} s waited off the CPU (--modeled-reset), the 1 x 1 reference's too; "
            "the push's other work (the daemons', the routes', the router's) is real"
        )
    if args.png is not None:
        drawn = fleet_plot.draw(fleets, args.png)
        report.notes.append(f"picture: {drawn}" if drawn else "picture: one node count, no "
                            "growth to draw")  # fmt: skip
    raised = (
        f"; raised to {inotify['raised_to']} for the run, {inotify['limit']} put back"
        if inotify["raised_to"]
        else ""
    )
    report.notes.append(
        f"inotify instances: limit {inotify['limit']}, {inotify['in_use_at_start']} in use at "
        f"the start: room for {inotify['shards_fit']} shards{raised}"
    )
    emit(report, args.json)


# --------------------------------------------------------------------------- one fleet


class FleetError(DynamodError):
    """The fleet asked for cannot run on this machine; says why with the numbers."""


def inotify_instances() -> tuple[int, int]:
    """(fs.inotify.max_user_instances, the inotify instances this user's processes hold)."""
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    uid, used = os.geteuid(), 0
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(proc.path).st_uid != uid:
                continue
            for fd in os.scandir(f"{proc.path}/fd"):
                with contextlib.suppress(OSError):
                    used += os.readlink(fd.path) == "anon_inode:inotify"
    return limit, used


INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")


@contextlib.contextmanager
def inotify_room(shards: int, *, raise_limit: bool) -> Iterator[dict[str, Any]]:
    """Room in the kernel's inotify instances for `shards` mocker-engine shards, or a
    FleetError with the numbers. With `raise_limit`, a limit too low is raised for the
    block (root) and put back after it, whatever happens inside."""
    limit, used = inotify_instances()
    room = shards_that_fit(limit, used)
    facts: dict[str, Any] = {
        "limit": limit,
        "in_use_at_start": used,
        "shards_fit": room,
        "raised_to": None,
    }
    if shards <= room:
        yield facts
        return
    need = shards * INOTIFY_PER_SHARD
    if not raise_limit:
        raise FleetError(
            f"{shards} shards need {need} inotify instances (each shard's mocker engine: "
            f"{INOTIFY_PER_SHARD}); fs.inotify.max_user_instances is {limit} and {used} are "
            f"in use: at most {room} shards here. Ask for fewer (--nodes, --shards-per-node) "
            "or let the benchmark raise the limit for the run (--raise-inotify, root)"
        )
    raised = used + need + INOTIFY_RESERVE
    try:
        INOTIFY_LIMIT.write_text(f"{raised}\n")
    except OSError as exc:
        raise FleetError(
            f"could not raise fs.inotify.max_user_instances from {limit} to {raised} "
            f"({exc.strerror}); {shards} shards need {need}: run as root or ask for fewer"
        ) from exc
    facts["raised_to"] = raised
    print(
        f"# inotify: fs.inotify.max_user_instances {limit} -> {raised} for the run",
        file=sys.stderr,
        flush=True,
    )
    try:
        yield facts
    finally:
        INOTIFY_LIMIT.write_text(f"{limit}\n")
        print(
            f"# inotify: fs.inotify.max_user_instances back to {limit}", file=sys.stderr, flush=True
        )


def waves(names: list[str]) -> list[list[str]]:
    """The nodes holding etcd's members together (a member alone has no quorum), then
    every other node on its own."""
    first = members(names)
    return [first] + [[name] for name in names if name not in first]


def up_in_waves(rig: ClusterRig, per_node: int) -> list[float]:
    """Start the fleet in `waves`; the seconds each wave took."""
    took = []
    for wave in waves(rig.names):
        began = time.monotonic()
        rig.up(wave, timeout=max(600, 4 * per_node * len(wave)))
        took.append(time.monotonic() - began)
        print(f"# fleet: {', '.join(wave)} up in {took[-1]:.1f}s", file=sys.stderr, flush=True)
    return took


def run_fleet(
    n_nodes: int,
    per_node: int,
    *,
    quick: bool,
    faults: bool,
    lease: int | None = None,
    limits: dict[str, int] | None = None,
    keep: bool = False,
    staggered: bool = False,
    live_timeout: float | None = None,
    max_starting: int | None = None,
    max_updating: int | None = None,
    idle_s: float = IDLE_S,
    heartbeat_timeout: float | None = None,
    cut: str = "last",
    profile: Path | None = None,
    modeled_reset: float | None = None,
    early_pushes: int = 1,
    direct_etcd: bool = False,
    sched_trace: bool = False,
) -> dict[str, Any]:
    """Start a fleet, measure it, stop it. A clean run leaves nothing in /tmp unless `keep`;
    a failed one keeps the daemons' logs in its work dir (named in the error) and kills
    every process."""
    print(f"# fleet: {n_nodes} nodes x {per_node} shards", file=sys.stderr, flush=True)
    variables = {"workers": str(per_node), "trainer_steps": "0", "worker_engine": "mocker"}
    units = paths.units_dir()
    work_dir = Path(tempfile.mkdtemp(prefix="dmc", dir="/tmp"))
    stack = work_dir / "fleet-stack.toml"
    text = STACK.read_text() if lease is None else with_lease(STACK.read_text(), lease, units)
    text = with_shard_live_timeout(with_shard_limits(text, limits or {}), live_timeout)
    text = with_max_updating(with_max_starting(text, max_starting), max_updating)
    text = with_modeled_reset(with_heartbeat(text, heartbeat_timeout), modeled_reset)
    # repeated early pushes read etcd's own time for each transaction around them
    etcd_metrics = "extensive" if early_pushes > 1 else None
    text = with_etcd_metrics(text, etcd_metrics)
    stack.write_text(replicated(text, NODE_NAMES[:n_nodes], units, relay=not direct_etcd))
    rig = ClusterRig(n_nodes, stack=stack, variables=variables, work_dir=work_dir)
    rig.open()
    cluster_table = tomllib.loads(text)["cluster"]
    lease_s = cluster_table["lease_ttl"]
    result: dict[str, Any] = {"nodes": n_nodes, "shards": n_nodes * per_node,
                              "registry_lease_s": lease_s,
                              "heartbeat_timeout_s": cluster_table.get("heartbeat_timeout"),
                              "shard_limits": limits or {},
                              "shard_live_timeout_s": live_timeout,
                              "max_starting": max_starting,
                              "max_updating": max_updating,
                              "modeled_reset_s": modeled_reset,
                              "etcd_metrics": etcd_metrics or "basic",
                              "dynamo_etcd": "members" if direct_etcd else "relay",
                              "sched_trace": sched_trace}  # fmt: skip
    last_step = EARLY_STEP + early_pushes - 1  # the version the faults' load asks for
    failed = True
    begun: dict[str, float] = {}  # phase -> wall clock at its start (the logs' clock)
    try:
        started = time.monotonic()
        begun["up"], host_at_start = time.time(), host.counters()
        # a shard's start is ~1 s of CPU on this machine's 2 cores: the big fleets need longer
        shards = result["shards"]
        if staggered:
            result["up_waves_s"] = up_in_waves(rig, per_node)
        else:
            rig.up(timeout=max(600, 4 * shards))
        rig.wait(
            "every shard routed", lambda: len(rig.routed()) >= shards, max(300, 2 * shards), 0.5
        )
        result["up_s"] = time.monotonic() - started
        up_host = host.window(host_at_start)
        result["up_cpu"] = {  # the daemons started with the fleet: all their CPU so far
            "machine_busy_s": up_host["busy_s"],
            "host": up_host,
            "daemons_s": sum(cpu_of([daemon_pid(rig, node) for node in rig.names]).values()),
        }
        phases = result["phase_s"] = {"up": result["up_s"]}
        for name, measure in [
            ("idle", lambda: idle_cost(rig, window=1.0 if quick else idle_s)),
            ("scan", lambda: exposure_scan(rig, rig.names[0])),
            ("identity", lambda: identity_look(rig, *((2, 5) if quick else ()))),
            ("push", lambda: push_all(rig, step=1, profile=profile)),
            ("whole", lambda: whole_again(rig, shards)),
            ("early", lambda: push_early(rig, EARLY_STEP, shards, LOAD, 1.0 if quick else 3.0,
                                         sched_trace)),
            ("whole_early", lambda: whole_again(rig, shards)),
            ("early_again", lambda: push_early_again(
                rig, EARLY_STEP, early_pushes - 1, shards, LOAD, 1.0 if quick else 3.0,
                lambda: whole_again(rig, shards), sched_trace) if early_pushes > 1 else None),
            ("status", lambda: status_all(rig, rig.names[-1:] if quick else rig.names, quick)),
            ("kill", lambda: kill_tenth(rig, last_step) if faults and not quick else None),
            ("cut", lambda: cut_one(rig, cut_target(rig, cut), 1.0 if quick else 2.0, LOAD,
                                    last_step) if faults else None),
        ]:
            began, begun[name] = time.monotonic(), time.time()
            value = measure()
            if value is not None:
                result[name], phases[name] = value, time.monotonic() - began
        result["health"] = health(rig, begun)
        stopping = time.monotonic()
        down = rig.run(rig.names[0], "down", "--cluster", timeout=600)
        result["down_s"] = phases["down"] = time.monotonic() - stopping
        result["down_cluster_rc"] = down.returncode
        failed = False
    finally:
        problems = rig.close()
        if failed:  # an error or a stop signal on its way out: the logs stay, named here
            print(f"# fleet: {n_nodes} nodes did not finish; logs in {rig.work_dir}",
                  file=sys.stderr, flush=True)  # fmt: skip
    if problems:  # a failure's own exception has left through the `finally` above
        raise ClusterError(f"fleet of {n_nodes} nodes failed; logs in {rig.work_dir}: {problems}")
    if keep:
        print(f"# fleet: logs kept in {rig.work_dir}", file=sys.stderr, flush=True)
    else:
        shutil.rmtree(rig.work_dir, ignore_errors=True)
    return result


def whole_again(rig: ClusterRig, shards: int) -> dict[str, Any]:
    """After the push: until every shard is routed again. A shard the push cost (killed
    for missing its liveness probe while the cores were short) restarts, replays the pushed
    version and rejoins; the status call and the faults start from the whole fleet, so the
    kill's capacity is the fleet's, not what the push left."""
    began = time.monotonic()
    short = shards - len(rig.routed())
    rig.wait("every shard routed again after the push", lambda: len(rig.routed()) >= shards,
             max(300, 2 * shards), 0.5)  # fmt: skip
    return {"s": time.monotonic() - began, "short_after_push": short}


def health(rig: ClusterRig, begun: dict[str, float]) -> dict[str, Any]:
    """The control plane over the whole run so far, from the daemons' logs and status: its
    event loops' stalls (daemon.loop_stalled, docs/operations.md "Logs"), per phase (`begun`:
    phase -> wall clock at its start), with the daemon's own CPU share of each (near 1: its
    own work; near 0: the machine's CPU withheld); the nodes marked lost (the cut's one is
    expected), entries the leader waited on (cluster.node_loss_deferred), the nodes its
    heartbeats judged silent and the silences they left to the lease, the daemons that
    became the leader, and the shards' restarts (the kill's are expected)."""
    logged = rig.logged("daemon.loop_stalled", "cluster.node_lost", "cluster.node_loss_deferred",
                        "cluster.node_silent", "cluster.heartbeat_withheld", "cluster.leader")
    events = [e for e in logged if e["event"] == "daemon.loop_stalled"]
    stalls = [float(e.get("seconds", 0.0)) for e in events]
    order = sorted(begun.items(), key=lambda item: item[1])
    per_phase: dict[str, dict[str, Any]] = {}
    for event in events:
        at = iso_epoch(str(event["timestamp"]))
        phase = next((name for name, t in reversed(order) if t <= at), "before")
        row = per_phase.setdefault(phase, {"n": 0, "max_s": 0.0, "total_s": 0.0, "shares": []})
        row["n"] += 1
        row["max_s"] = max(row["max_s"], float(event.get("seconds", 0.0)))
        row["total_s"] += float(event.get("seconds", 0.0))
        row["shares"].append(float(event.get("cpu_share", math.nan)))
    for row in per_phase.values():
        row["cpu_share_median"] = statistics.median(row.pop("shares"))
    restarts = shard_restarts(rig)
    return {
        "loop_stalls": len(stalls),
        "loop_stall_max_s": max(stalls, default=0.0),
        "loop_stall_total_s": sum(stalls),
        "loop_stalls_by_phase": per_phase,
        "marked_lost": [str(e.get("node")) for e in logged if e["event"] == "cluster.node_lost"],
        "loss_deferred": sum(e["event"] == "cluster.node_loss_deferred" for e in logged),
        # the leader's heartbeats: nodes it judged silent, and silences it left to the
        # lease with why (cluster/heartbeat.py); and each node that became the leader
        "silent": [str(e.get("node")) for e in logged if e["event"] == "cluster.node_silent"],
        "heartbeat_withheld": [
            {"node": e.get("node"), "silent_s": e.get("silent_s"), "why": e.get("why")}
            for e in logged
            if e["event"] == "cluster.heartbeat_withheld"
        ],
        "leaders": [str(e.get("node")) for e in logged if e["event"] == "cluster.leader"],
        "shard_restarts": restarts,
    }


def shard_restarts(rig: ClusterRig) -> int:
    """Every node's shards' restarts so far."""
    return sum(restarts_of(rig.status(node)["units"]) for node in rig.names)


def restarts_of(units: list[dict[str, Any]]) -> int:
    return sum(u["restarts"] for u in units if u["name"].startswith("worker@"))


def shard_pids(rig: ClusterRig, node: str) -> dict[str, int]:
    return pids_of(rig.status(node)["units"], shards=True)


def idle_cost(rig: ClusterRig, window: float) -> dict[str, Any]:
    """Over `window` seconds of no load: each shard's CPU share and memory, each daemon's
    CPU share and memory, per shard it supervises; etcd's reads and writes per second."""
    shards = {
        (node, unit): pid for node in rig.names for unit, pid in shard_pids(rig, node).items()
    }
    daemons = {node: daemon_pid(rig, node) for node in rig.names}
    pids = [*shards.values(), *daemons.values()]
    etcd_before = etcd_counters(rig)
    before = cpu_of(pids)
    started = time.monotonic()
    time.sleep(window)
    share = {pid: used / window * 100 for pid, used in cpu_since(before).items()}
    etcd_after = etcd_counters(rig)
    took = time.monotonic() - started
    per_node = len(shards) / len(rig.names)
    return {
        "window_s": took,
        "etcd_writes_by_key": writes_by_key(rig, etcd_before, etcd_after),
        "etcd_writes_per_s": writes(etcd_before, etcd_after) / took,
        "etcd_history_kb_per_min": history_kb(etcd_before, etcd_after) / took * 60,
        "etcd_reads_per_s": (etcd_after["ranges"] - etcd_before["ranges"]) / took,
        "shard_cpu_pct": statistics.mean(share[p] for p in shards.values() if p in share),
        "shard_rss_mb": statistics.mean(rss_mb(p) for p in shards.values() if p in share),
        "shard_pss_mb": statistics.mean(pss_mb(p) for p in shards.values() if p in share),
        "shards_gone": sum(p not in share for p in shards.values()),
        "daemon_cpu_pct_per_shard": statistics.mean(share[p] for p in daemons.values()) / per_node,
        "daemon_rss_mb": statistics.mean(rss_mb(p) for p in daemons.values()),
        "daemon_rss_mb_per_shard": statistics.mean(rss_mb(p) for p in daemons.values()) / per_node,
    }


def writes_by_key(
    rig: ClusterRig, before: dict[str, float], after: dict[str, float]
) -> dict[str, dict[str, float]]:
    """etcd's writes between two `etcd_counters` readings, by kind of key, replayed from
    the head's member (bench/fleet_history.py)."""
    first, last = int(before["revision"]) + 1, int(after["revision"])
    totals: dict[str, dict[str, float]] = rig.in_node(rig.names[0], lambda: asyncio.run(
        fleet_history.writes_between("http://127.0.0.1:2379", first, last)))  # fmt: skip
    return totals


def etcd_counters(rig: ClusterRig) -> dict[str, float]:
    """etcd's counters: the store's (keys, revision, writes: every member applies each) from
    the head's member, what each member serves its own clients (watchers, reads) summed."""
    each = [prometheus(metric_samples(member_metrics(rig, m)), ETCD_METRICS)
            for m in members(rig.names)]  # fmt: skip
    served = ("watchers", "watch_streams", "ranges")
    return {k: sum(e[k] for e in each) if k in served else each[0][k] for k in each[0]}


def push_all(rig: ClusterRig, step: int, profile: Path | None = None) -> dict[str, Any]:
    """One update pushed to every shard: the trainer's stall (its blocking call), the
    daemon's own total, the head's shards' own times, etcd's counters around it; with
    `profile`, the head's and the last node's daemons sampled through it, and a shard of
    each (py-spy)."""
    checkpoint = make_checkpoint(rig, rig.work_dir / f"step-{step}", 1.0 + 0.01 * step)
    before = etcd_counters(rig)
    rows = {node: rig.status(node)["units"] for node in rig.names}  # outside the CPU window
    of_node = {node: pids_of(units, shards=True) for node, units in rows.items()}
    shards = [pid for theirs in of_node.values() for pid in theirs.values()]
    daemons = [daemon_pid(rig, node) for node in rig.names]
    # the rest of the stack, by unit name over the nodes: where the CPU that is neither the
    # shards' nor the daemons' goes (the frontend's canaries, etcd's writes and watches)
    rest = [(unit, pid) for units in rows.values()
            for unit, pid in pids_of(units, shards=False).items()]  # fmt: skip
    restarts_before = sum(restarts_of(units) for units in rows.values())
    pids = dict(zip(rig.names, daemons, strict=True))
    sampled = {n: pids[n] for n in dict.fromkeys([rig.names[0], rig.names[-1]])}
    profilers = []
    if profile is not None:  # and a shard of each: the head's first, the last node's last
        for node, pick_shard in ((rig.names[0], min), (rig.names[-1], max)):
            if of_node[node]:
                name = pick_shard(of_node[node], key=lambda unit: int(unit.rpartition("@")[2]))
                sampled[f"{node}/{name}"] = of_node[node][name]
        label = f"{len(rig.names)}x{len(shards) // len(rig.names)}"
        profilers = fleet_profile.start(sampled, profile, label)
    cpu_before = cpu_of([*shards, *daemons, *(pid for _, pid in rest)])
    threads_before = threads_of([*shards, *daemons])
    host_before = host.counters()
    started = time.monotonic()
    try:
        answer = Client(rig.state_dir(rig.names[0]), timeout=900).policy_push(step, checkpoint)
        stall = time.monotonic() - started
        machine = host.window(host_before)  # py-spy's own CPU is the machine's, not ours
        used = cpu_since(cpu_before)
    finally:
        profiled = fleet_profile.stop(profilers) if profilers else None
    busy = machine["busy_s"]
    for node, sampled_profile in (profiled or {}).items():  # the share's whole (fleet_profile)
        sampled_profile["cpu_s"] = used.get(sampled[node])
    threads_after = threads_of([*shards, *daemons])
    restarted = shard_restarts(rig) - restarts_before  # killed inside the push (liveness)
    after = etcd_counters(rig)
    by_key = writes_by_key(rig, before, after)
    acks = answer["acks"]
    bad = {k: v.get("error") or v for k, v in acks.items() if not v.get("ok")}
    if bad:
        raise ClusterError(f"push of step {step} failed on {bad}")
    totals = [float(a["total_ms"]) for a in acks.values()]
    # the head's own shards ack in the answer; the other nodes' daemons replay the version
    # into theirs, and the head waits until the registry shows them at it
    others = [v for shards in answer.get("nodes", {}).values() for v in shards.values()]
    return {
        "stall_s": stall,
        "daemon_s": float(answer["seconds"]),
        "acked": len(acks) + len([v for v in others if v == step]),
        "behind": answer.get("behind", []),
        "shard_median_ms": statistics.median(totals),
        "shard_max_ms": max(totals),
        # where a shard's own time goes: each step's median over the head's shards
        "shard_steps_ms": steps_median([a.get("ms", {}) for a in acks.values()]),
        # in line for an update slot (`[policy] max_updating`), the head's shards
        "shard_waited_max_ms": max(float(a.get("waited_ms", 0.0)) for a in acks.values()),
        "shards_restarted": restarted,
        "etcd_before": before,
        "etcd_after": after,
        "etcd_writes": writes(before, after),
        "etcd_revisions": after["revision"] - before["revision"],
        "etcd_history_kb": history_kb(before, after),
        "etcd_writes_by_key": by_key,
        "etcd_write_rate": writes(before, after) / stall,
        "cpu": {
            "busy_s": busy,
            "busy_pct": busy / (stall * CORES) * 100,
            "shards_s": sum(used[pid] for pid in shards if pid in used),
            "shards_by_thread": by_thread(
                threads_before, threads_after, {p: used[p] for p in shards if p in used}
            ),
            "daemons_s": sum(used[pid] for pid in daemons if pid in used),
            "others_s": sum(used.get(pid, 0.0) for _, pid in rest),
            "others_by_unit": by_unit(rest, used),
            "daemons_by_thread": by_thread(
                threads_before, threads_after, {p: used[p] for p in daemons if p in used}
            ),
            # a shard restarted meanwhile: its old process's CPU is not counted
            "shards_gone": sum(pid not in used for pid in shards),
            # the host's part: steal, kdamond, pages read back in (bench/host.py)
            "host": machine,
        },
        "profile": profiled,
    }


CORES = os.cpu_count() or 1


def by_unit(pids: list[tuple[str, int]], used: dict[int, float]) -> dict[str, float]:
    """CPU seconds summed by unit name over the nodes; a process gone meanwhile counts 0."""
    out: dict[str, float] = {}
    for unit, pid in pids:
        out[unit] = out.get(unit, 0.0) + used.get(pid, 0.0)
    return out


def steps_median(timings: list[dict[str, float]]) -> dict[str, float]:
    """Each step's median ms over the shards that took it (pause, load, flush, verify...),
    in the order the first shard took them."""
    names = list(dict.fromkeys(name for one in timings for name in one))
    return {n: statistics.median(t[n] for t in timings if n in t) for n in names}


def status_all(rig: ClusterRig, nodes: list[str], quick: bool) -> dict[str, Any]:
    """`dynamod status --json` on each node, as a user runs it: the CLI's wall time, beside
    the CLI's start alone; and the daemon's answer alone (over its socket, from here)."""
    walls, sizes, answers, seen = {}, {}, {}, {}
    for node in nodes:
        started = time.monotonic()
        rig.status(node)
        answers[node] = (time.monotonic() - started) * 1000
        started = time.monotonic()
        done = rig.run(node, "status", "--json", timeout=60)
        walls[node] = time.monotonic() - started
        if done.returncode != 0:
            raise ClusterError(f"status --json on {node}: exit {done.returncode}: {done.stderr}")
        sizes[node] = len(done.stdout)
        seen[node] = len((json.loads(done.stdout).get("cluster") or {}).get("nodes", []))
    started = time.monotonic()  # the CLI's own start: the same command with no daemon there
    if not quick:
        subprocess.run(
            [sys.executable, "-m", "dynamod", "--state-dir", str(rig.work_dir / "none"),
             "status", "--json"], capture_output=True, timeout=60,
        )  # fmt: skip
    cli_start = math.nan if quick else time.monotonic() - started
    return {
        "cli_s": walls,
        "max_s": max(walls.values()),
        "cli_start_s": cli_start,
        "answer_ms": answers,
        "answer_max_ms": max(answers.values()),
        "json_kb": max(sizes.values()) / 1024,
        "nodes_seen": seen,  # nodes in each answer's registry view
    }


def instance_ids(rig: ClusterRig, node: str, units: set[str]) -> set[int]:
    rows = rig.status(node)["units"]
    return {
        i
        for u in rows
        if u["name"] in units
        for i in (u.get("dynamo") or {}).get("instance_ids", [])
    }


def kill_tenth(rig: ClusterRig, step: int) -> dict[str, Any]:
    """Under load, SIGKILL 10 % of the shards at once (spread over the nodes): until every
    one serves again (a new process ready, routed as many instances as before) and the
    requests that failed meanwhile."""
    shards = [
        (node, unit, pid) for node in rig.names for unit, pid in shard_pids(rig, node).items()
    ]
    k = max(1, math.ceil(len(shards) / 10))
    victims = shards[:: len(shards) // k][:k]
    old_ids = set().union(*(instance_ids(rig, n, {u}) for n, u, _ in victims))
    capacity = len(rig.routed())
    gen = rig.load(LOAD, "tiny-cpu", lambda: step)  # the version last pushed

    def back() -> bool:
        if len(rig.routed() - old_ids) < capacity:
            return False
        for node, unit, pid in victims:
            row = next(u for u in rig.status(node)["units"] if u["name"] == unit)
            if row["pid"] in (None, pid) or row["state"] != "ready":
                return False
        return True

    gen.start()
    try:
        time.sleep(2.0)  # steady load first
        killed = time.monotonic()
        for _, _, pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        rig.wait(f"{k} killed shards serving again", back, max(120, 5 * k), 0.2)
        back_s = time.monotonic() - killed
        time.sleep(1.0)  # load on the whole fleet again
    finally:
        gen.stop()
    since = killed - gen.origin
    during = [r for r in gen.requests if r.done >= since]
    failed = [r for r in during if not r.ok]
    return {
        "killed": k,
        "back_s": back_s,
        "requests": len(during),
        "failed": len(failed),
        "failed_trainer": len([r for r in failed if r.required is not None]),
        "errors": Counter(f"{r.status} {(r.error or '')[:120]}" for r in failed).most_common(3),
    }


# --------------------------------------------------------------------------- the report


def one_shards_push(reference: dict[str, Any] | None, full: dict[str, Any]) -> tuple[float, str]:
    """What "one shard's push" is, in seconds, and in words: the trainer's stall in a
    1-node x 1-shard fleet, the median over its pushes where it pushed early too
    (`--early-pushes` above 1: one push's stall moved 0.064-0.092 s from run to run, and
    every ratio with it); without one (quick), the median shard's own update time."""
    if reference is not None:
        stalls = [float(reference["push"]["stall_s"])]
        if len(early := early_stalls(reference)) > 1:  # one shard: an early push is whole
            stalls += early
            what = f"the median stall of a 1 x 1 fleet's {len(stalls)} pushes"
            return statistics.median(stalls), what
        return stalls[0], "the stall in a 1 x 1 fleet"
    return full["push"]["shard_median_ms"] / 1000, "the head's median shard's own time (quick)"


def judge(report: Report, reference: dict[str, Any] | None, fleets: list[dict[str, Any]]) -> None:
    full = fleets[-1]
    ref_s = one_shards_push(reference, full)[0]
    report.tables += [size_table(reference, fleets, ref_s), push_cpu_table(fleets),
                      host_table(fleets), thread_table(fleets),
                      thread_table(fleets, "daemons")]  # fmt: skip
    if any(isinstance(pick(f, "push", "profile"), dict) for f in fleets):
        report.tables.append(fleet_profile.profile_table(fleets))
    report.tables.append(early_table(fleets))
    every = [f for f in (reference, *fleets) if f]  # the 1 x 1 reference's pushes too
    report.tables.append(split_table(every, pushes_of))
    if any(f.get("sched_trace") for f in fleets):
        report.tables.append(behind_table(every, pushes_of))
    if any(len(early_stalls(f)) > 1 for f in fleets):  # `--early-pushes` above 1
        report.tables.append(early_repeat_table(fleets, ref_s))
    report.tables += [fault_table(fleets), health_table(fleets)]
    report.tables += [cost_table(fleets), history_table(fleets), scan_table(fleets),
                      identity_table(fleets),
                      growth_table(fleets)]
    report.tables += [step_table(reference, fleets), shard_table(full)]
    judge_targets(report, reference, full, [f for f in fleets if "cut" in f])
    report.data = {"reference": reference, "fleets": fleets}
    report.notes += notes(fleets)


def judge_targets(
    report: Report,
    reference: dict[str, Any] | None,
    full: dict[str, Any],
    cut: list[dict[str, Any]],
) -> None:
    """The issue's targets, on the largest fleet (`full`) and the fleets that were cut."""
    ref_s, ref_what = one_shards_push(reference, full)
    at = f"at {full['nodes']} nodes x {full['shards'] // full['nodes']} shards"
    report.target(
        f"push to every shard: trainer's stall / one shard's ({ref_what}, {ref_s:.2f} s), {at}",
        full["push"]["stall_s"] / ref_s, 2.0, "x",
    )  # fmt: skip
    report.target(
        f"push answered at 1 shard serving (--serving 1): trainer's stall / one shard's, {at}",
        pick(full, "early", "stall_s") / ref_s, 2.0, "x",
    )  # fmt: skip
    stalls = early_stalls(full)
    if len(stalls) > 1:
        report.target(
            f"push answered at 1 shard serving: the slowest of {len(stalls)} pushes' stall / "
            f"one shard's, {at}", max(stalls) / ref_s, 2.0, "x",
        )  # fmt: skip
    report.target(f"status --json on any node, {at}", full["status"]["max_s"], 1.0, "s")
    if cut:
        report.target(f"one node cut: out of routing, {at}", pick(cut[-1], "cut", "rerouted_s"),
                      2.0, "s")  # fmt: skip
        report.target(
            "one node cut: requests lost after re-routing (every fleet)",
            sum(f["cut"]["failed_after_reroute"] for f in cut), 0, "requests",
        )  # fmt: skip


def size_table(
    reference: dict[str, Any] | None, fleets: list[dict[str, Any]], ref_s: float
) -> Table:
    table = Table(
        "Per fleet: start, a push to every shard, status (a 1 x 1 row is the reference)",
        ["nodes", "shards", "up s", "push: trainer's stall s", "daemon's total s",
         "stall / one shard's", "head's shards: median ms", "slowest ms", "behind",
         "shards restarted in it", "all routed again s", "--serving 1: trainer's stall s",
         "its stall / one shard's", "its every shard at the step s", "status --json CLI s (max)",
         "CLI start alone s", "daemon's answer ms (max)", "status KB", "down s"],
        digits=2,
    )  # fmt: skip
    for f in [reference, *fleets] if reference is not None else fleets:
        p, st = f["push"], f["status"]
        table.rows.append(
            [f["nodes"], f["shards"], f["up_s"], p["stall_s"], p["daemon_s"],
             p["stall_s"] / ref_s, p["shard_median_ms"], p["shard_max_ms"], len(p["behind"]),
             p.get("shards_restarted", math.nan), pick(f, "whole", "s"),
             pick(f, "early", "stall_s"), pick(f, "early", "stall_s") / ref_s,
             pick(f, "early", "every_shard_s"), st["max_s"],
             pick(st, "cli_start_s"), st["answer_max_ms"], st["json_kb"], f["down_s"]]
        )  # fmt: skip
    return table


def step_table(reference: dict[str, Any] | None, fleets: list[dict[str, Any]]) -> Table:
    """A shard's own push by step: the head's shards' median ms of each (the daemon's
    admin calls and the router's verify), so a change of one step shows by name."""
    rows = [reference, *fleets] if reference is not None else fleets

    def steps_of(fleet: dict[str, Any]) -> dict[str, float]:
        steps = pick(fleet, "push", "shard_steps_ms")  # NaN in a report from before it
        return steps if isinstance(steps, dict) else {}

    names = list(dict.fromkeys(n for f in rows for n in steps_of(f)))
    table = Table("A shard's push by step: the head's shards' median ms",
                  ["nodes", "shards", *names, "total (median)"], digits=1)  # fmt: skip
    for f in rows:
        steps = steps_of(f)
        table.rows.append([f["nodes"], f["shards"], *(steps.get(n, math.nan) for n in names),
                           f["push"]["shard_median_ms"]])  # fmt: skip
    return table


def push_cpu_table(fleets: list[dict[str, Any]]) -> Table:
    """Where the machine's CPU went during the push: a stall that is the machine's busy CPU
    time over its cores is bound by the machine (every node's shards share its cores), not
    by waiting; the daemons' part is dynamod's own."""
    table = Table(
        f"The push's CPU: every process on this machine during the trainer's stall ({CORES} "
        "cores)",
        ["nodes", "shards", "stall s", "machine busy %", "busy CPU s", "busy CPU s / cores",
         "shards' CPU s", "daemons' CPU s", "daemons' share %", "daemons' CPU ms / shard",
         "other units' CPU s (largest)", "the rest s", "shards gone meanwhile (not counted)"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        c = f["push"]["cpu"]
        others = c.get("others_s", math.nan)  # NaN in a report from before it
        by_unit = c.get("others_by_unit") or {}
        largest = max(by_unit, key=by_unit.__getitem__, default=None)
        table.rows.append(
            [f["nodes"], f["shards"], f["push"]["stall_s"], c["busy_pct"], c["busy_s"],
             c["busy_s"] / CORES, c["shards_s"], c["daemons_s"],
             c["daemons_s"] / c["busy_s"] * 100 if c["busy_s"] else math.nan,
             c["daemons_s"] / f["shards"] * 1000,
             f"{others:.2f} ({largest} {by_unit[largest]:.2f})" if largest else others,
             c["busy_s"] - c["shards_s"] - c["daemons_s"] - others, c.get("shards_gone", 0)]
        )  # fmt: skip
    return table


def host_table(fleets: list[dict[str, Any]]) -> Table:
    """The host's own part in the start and in the push (bench/host.py): the CPU its
    hypervisor took (steal), DAMON's kernel thread, the pages read back in. Two runs of the
    same code whose stalls differ while these do not were not slowed by the host."""
    table = Table(
        "The host in the start and in the push: steal, kdamond's CPU, pages read back in",
        ["nodes", "shards", "phase", "s", *host.COLUMNS],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        for phase, seconds, h in [
            ("start", f.get("up_s"), pick(f, "up_cpu", "host")),
            ("push", pick(f, "push", "stall_s"), pick(f, "push", "cpu", "host")),
        ]:
            if not isinstance(h, dict):
                continue  # a run from before the host was read
            table.rows.append([f["nodes"], f["shards"], phase, seconds, *host.cells(h)])
    return table


def fault_table(fleets: list[dict[str, Any]]) -> Table:
    table = Table(
        "Faults under load (3 clients, 6 req/s from the head): one node's link cut, "
        "kill -9 of 10 % of the shards at once",
        ["nodes", "shards", "cut: node (held)", "lost s", "by", "out of routing s", "requests",
         "failed before re-route", "lost after re-route", "falsely lost",
         "killed", "serving again s", "requests", "failed"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        c, k = "cut", "kill"
        table.rows.append(
            [f["nodes"], f["shards"], cut_node(f.get("cut")), pick(f, c, "lost_s"),
             lost_by((f.get("cut") or {}).get("why") or ""),
             pick(f, c, "rerouted_s"),
             pick(f, c, "requests"), pick(f, c, "failed_before_reroute"),
             pick(f, c, "failed_after_reroute"), pick(f, c, "falsely_lost_n"),
             pick(f, k, "killed"), pick(f, k, "back_s"), pick(f, k, "requests"),
             pick(f, k, "failed")]
        )  # fmt: skip
    return table


def cut_node(cut: dict[str, Any] | None) -> str:
    """The node cut, and what it held: the cluster's leader key, etcd's raft leader."""
    if not cut:
        return "-"
    held = [what for what, key in (("leader", "was_leader"), ("etcd leader", "held_etcd_leader"))
            if cut.get(key)]  # fmt: skip
    return f"{cut['node']} ({', '.join(held)})" if held else str(cut["node"])


def shard_settings(fleet: dict[str, Any]) -> str:
    """What the run set on its shards beyond the stack: limits, a longer liveness timeout."""
    settings = [f"{k} {v}" for k, v in fleet.get("shard_limits", {}).items()]
    if fleet.get("shard_live_timeout_s") is not None:
        settings.append(f"liveness timeout {fleet['shard_live_timeout_s']:g} s")
    for key in ("max_starting", "max_updating"):
        if fleet.get(key) is not None:
            settings.append(f"{key} {fleet[key]}")
    if fleet.get("modeled_reset_s") is not None:
        settings.append(f"engine reset modeled {fleet['modeled_reset_s']:g} s off the CPU")
    return ", ".join(settings) or "-"


def health_table(fleets: list[dict[str, Any]]) -> Table:
    table = Table(
        "The control plane over the run (start to the end of the faults): the daemons' "
        "event-loop stalls, nodes marked lost (the cut's node is expected once), shard "
        "restarts (the kill's are expected)",
        ["nodes", "shards", "shard settings", "loop stalls", "longest s", "stalled s in all",
         "of them in the start", "their daemon CPU share (median)",
         "daemons' CPU s in the start", "machine busy CPU s in the start",
         "nodes marked lost", "marks deferred", "shard restarts", "of them killed"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        h = f.get("health", {})
        table.rows.append(
            [f["nodes"], f["shards"], shard_settings(f), h.get("loop_stalls", math.nan),
             h.get("loop_stall_max_s", math.nan), h.get("loop_stall_total_s", math.nan),
             pick(h, "loop_stalls_by_phase", "up", "n"),
             pick(h, "loop_stalls_by_phase", "up", "cpu_share_median"),
             pick(f, "up_cpu", "daemons_s"), pick(f, "up_cpu", "machine_busy_s"),
             " ".join(h.get("marked_lost", [])) or "-", h.get("loss_deferred", math.nan),
             h.get("shard_restarts", math.nan), pick(f, "kill", "killed")]
        )  # fmt: skip
    return table


def cost_table(fleets: list[dict[str, Any]]) -> Table:
    table = Table(
        "Idle cost per shard, and etcd (3 members from 3 nodes on): around one push, and idle",
        ["nodes", "shards", "shard CPU %", "shard PSS MB", "daemon CPU % / shard",
         "daemon RSS MB", "daemon RSS MB / shard", "etcd keys", "watchers",
         "keys written / push", "revisions / push", "keys written / s of push",
         "reads / s idle", "keys written / s idle", "history KB / push",
         "history KB / min idle", "store MB at the end"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        i, p = f["idle"], f["push"]
        table.rows.append(
            [f["nodes"], f["shards"], i["shard_cpu_pct"], i["shard_pss_mb"],
             i["daemon_cpu_pct_per_shard"], i["daemon_rss_mb"], i["daemon_rss_mb_per_shard"],
             p["etcd_after"]["keys"], p["etcd_after"]["watchers"], p["etcd_writes"],
             p["etcd_revisions"], p["etcd_write_rate"], i["etcd_reads_per_s"],
             i["etcd_writes_per_s"], p.get("etcd_history_kb", math.nan),
             i.get("etcd_history_kb_per_min", math.nan),
             p["etcd_after"].get("db_bytes", math.nan) / 1e6]
        )  # fmt: skip
    return table


def history_table(fleets: list[dict[str, Any]]) -> Table:
    table = Table(
        "What the push and the idle window wrote to etcd, by kind of key "
        "(bench/fleet_history.py): KB of key and value kept in etcd's history (writes), "
        "most first",
        ["nodes", "shards", "when", "writes", "KB", "by key"],
        digits=1,
    )
    for f in fleets:
        idle = f.get("idle") or {}
        for when, by_key in (("push", f["push"].get("etcd_writes_by_key") or {}),
                             (f"idle {idle.get('window_s', 0):.0f} s",
                              idle.get("etcd_writes_by_key") or {})):  # fmt: skip
            table.rows.append([f["nodes"], f["shards"], when,
                               sum(v["writes"] for v in by_key.values()),
                               sum(v["kb"] for v in by_key.values()),
                               fleet_history.summary_of(by_key) or "-"])  # fmt: skip
    return table


def scan_table(fleets: list[dict[str, Any]]) -> Table:
    table = Table(
        "The exposure scan of the head's units, idle (bench/fleet_scan.py): CPU ms of one "
        "scan, median of 5 each way, side by side",
        ["nodes", "shards", "processes", "every process's open files read ms",
         "with the daemon's memo ms", "ratio", "sockets beyond loopback found"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        s = f["scan"]
        ratio = s["memo_ms"] / s["every_process_ms"] if s["every_process_ms"] else None
        table.rows.append([f["nodes"], f["shards"], s["processes"], s["every_process_ms"],
                           s["memo_ms"], ratio, "/".join(map(str, s["found"]))])  # fmt: skip
    return table


def identity_table(fleets: list[dict[str, Any]]) -> Table:
    looked = [f["identity"] for f in fleets if f.get("identity")]
    each = f"{looked[0]['rounds']} rounds of {looked[0]['looks']}" if looked else "rounds"
    table = Table(
        "The identity's look for other stacks' daemons, idle (bench/fleet_identity.py): ms a "
        f"look on the head's etcd member, median of {each} each way, side by side",
        ["nodes", "shards", "keys under dynamod/", "all of dynamod/ read: CPU ms",
         "etcd's CPU ms", "wall ms", "stack by stack: CPU ms", "etcd's CPU ms", "wall ms",
         "CPU ratio", "daemons found (each way)"],
        digits=2,
    )  # fmt: skip
    for f in fleets:
        look = f.get("identity")
        if not look:
            continue
        whole, scan = look["whole"], look["by_stack"]
        ratio = scan["cpu_ms"] / whole["cpu_ms"] if whole["cpu_ms"] else None
        table.rows.append([f["nodes"], f["shards"], look["keys"], whole["cpu_ms"],
                           whole["etcd_ms"], whole["wall_ms"], scan["cpu_ms"], scan["etcd_ms"],
                           scan["wall_ms"], ratio,
                           "/".join(str(n) for n in look["daemons"].values())])  # fmt: skip
    return table


def growth_table(fleets: list[dict[str, Any]]) -> Table:
    sizes = [f["nodes"] for f in fleets]
    table = Table(
        "Growth with the node count (shards per node fixed): exponent b of value ~ nodes^b "
        "(0 flat, 1 linear); above 1.25 is faster than linear",
        ["value", *[f"{n} nodes" for n in sizes], "exponent", "faster than linear"],
        digits=2,
    )
    for label, path in GROWTH.items():
        values = [pick(f, *path) for f in fleets]
        points = list(zip(sizes, values, strict=True))
        table.rows.append([label, *values, exponent(points), faster_than_linear(points)])
    return table


def shard_table(full: dict[str, Any]) -> Table:
    i = full["idle"]
    fit = MACHINE_GIB * 1024 / (i["shard_pss_mb"] + i["daemon_rss_mb_per_shard"])
    return Table(
        f"One shard (CPU worker, mocker engine), idle, in the {full['shards']}-shard fleet",
        ["RSS MB", "PSS MB", "CPU %", "its daemon's share MB", f"shards in {MACHINE_GIB} GiB"],
        [[i["shard_rss_mb"], i["shard_pss_mb"], i["shard_cpu_pct"],
          i["daemon_rss_mb_per_shard"], math.floor(fit)]],
        digits=1,
    )  # fmt: skip


def notes(fleets: list[dict[str, Any]]) -> list[str]:
    beat = fleets[-1].get("heartbeat_timeout_s")
    out = [
        f"registry lease {fleets[-1]['registry_lease_s']} s (cluster.lease_ttl); the "
        f"leader's heartbeat timeout {f'{beat:g} s' if beat else 'off'} "
        "(cluster.heartbeat_timeout: a cut node is lost at whichever comes first)",
        "shards in 24 GiB: the machine's memory over one shard's PSS plus its daemon's "
        "share, nothing else running (etcd, NATS, the frontend and the page cache need "
        "their part). Before memory, the kernel's inotify instances bound the fleet: each "
        "shard's mocker engine holds 2 (Dynamo's file discovery, two runtimes), "
        "fs.inotify.max_user_instances bounds them (its default 128: at most 56 shards)",
        "status: `dynamod status --json` (there is no `--cluster` flag; every node's "
        "status carries the registry's view of all nodes), timed as a user runs it, "
        "CLI start-up included",
        "etcd: 3 members (head, n1, n2) from 3 nodes on, the head's alone below (2 members "
        "lose their quorum with either; the cut is of the last node, never a member); "
        "keys and writes from the head's member, watchers and reads summed over members",
    ]
    faster = [label for label, path in GROWTH.items()
              if faster_than_linear([(f["nodes"], pick(f, *path)) for f in fleets])]  # fmt: skip
    if len(fleets) > 1:
        out.append("faster than linear: " + (", ".join(faster) or "nothing"))
    load = os.getloadavg()
    out.append(
        "load average at the end " + "/".join(f"{x:.2f}" for x in load)
        + (": provisional, a shared machine" if load[0] > 1 else "")
    )  # fmt: skip
    return out


if __name__ == "__main__":
    main()
