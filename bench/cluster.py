"""Benchmark - cluster: node loss and return on a simulated 3-node cluster.

    python -m bench.cluster [--quick] [--json] [--leases 2] [--heartbeat-timeouts 1.2,0]
                            [--hold 2] [--keep]

Three network namespaces as nodes (root needed), one dynamod each, one CPU shard per node,
etcd, NATS and the frontend on the head (units/stacks/cluster.toml). Each
round, under load from inside the head (half the requests require the current policy
version): cut a worker node's link; time until the head's registry view says `lost` and
until the head's router lists none of its shards; push a new version during the cut; heal;
time until its shard is admitted at that version (ready, acked, routed again). Rounds
alternate between n1 and n2 (quick: one round). Failed requests are counted before the
router dropped the node and after (the target: 0 after re-routing among requests that
require the current version). The full run does it on the stack's settings (a 2 s registry
lease, the leader's heartbeats at 1.2 s) and then, side by side, with the heartbeats off
(`--heartbeat-timeouts 1.2,0`: the lease alone decides, as before them); `--leases 2,1`
adds a 1 s lease (etcd's election timeout shortened to allow it).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import structlog

from bench.fleet_stack import ELECTION_TIMEOUT_MS, with_heartbeat, with_lease
from bench.procs import exit_on_signals
from bench.report import Report, Table, emit, entry, options
from dynamod.chaos.cluster import ClusterRig
from dynamod.chaos.model import Load
from dynamod.chaos.netns import can_create_namespaces
from dynamod.chaos.node_loss import NodeLossRound, lost_by, make_checkpoint, run_round
from dynamod.core import paths

STACK = paths.units_dir() / "stacks" / "cluster.toml"


def run_rounds(
    lease_ttl: int,
    heartbeat_timeout: float,
    rounds: int,
    load: Load,
    hold_s: float,
    keep: bool = False,
) -> tuple[list[NodeLossRound], dict[str, Any]]:
    """One cluster on a registry lease of `lease_ttl` s and the leader's heartbeats at
    `heartbeat_timeout` s (0: off), each cut held `hold_s` s after the push: its rounds,
    and its start/stop. Its work dir (the logs) goes after a clean run unless `keep`."""
    print(f"# cluster: registry lease {lease_ttl} s, heartbeat timeout {heartbeat_timeout:g} s",
          file=sys.stderr, flush=True)  # fmt: skip
    work_dir = Path(tempfile.mkdtemp(prefix="dmc", dir="/tmp"))
    stack = work_dir / "lease-stack.toml"
    text = with_lease(STACK.read_text(), lease_ttl, paths.units_dir())
    stack.write_text(with_heartbeat(text, heartbeat_timeout))
    results: list[NodeLossRound] = []
    rig = ClusterRig(
        3, stack=stack, variables={"workers": "1", "trainer_steps": "0"}, work_dir=work_dir
    )
    rig.open()
    started = time.monotonic()
    try:
        rig.up(timeout=240)
        up_s = time.monotonic() - started
        for k in range(rounds):
            node = ("n2", "n1")[k % 2]
            ckpt = make_checkpoint(rig, rig.work_dir / f"step-{k + 1}", 1.0 + 0.01 * (k + 1))
            results.append(
                run_round(rig, node, step=k + 1, checkpoint=ckpt, load=load, hold_s=hold_s)
            )
        down_started = time.monotonic()
        down = rig.run("head", "down", "--cluster", timeout=300)
        down_s = time.monotonic() - down_started
    finally:
        problems = rig.close()
    if not problems and not keep:  # a clean run leaves nothing in /tmp; a failed one keeps
        shutil.rmtree(rig.work_dir, ignore_errors=True)  # the logs
    else:
        print(f"# cluster: logs kept in {rig.work_dir}", file=sys.stderr, flush=True)
    return results, {"lease_ttl": lease_ttl, "heartbeat_timeout": heartbeat_timeout,
                     "hold_s": hold_s,
                     "up_s": up_s, "down_cluster_s": down_s,
                     "down_cluster_rc": down.returncode, "close_problems": problems}  # fmt: skip


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument(
        "--leases",
        default=None,
        help="registry leases to run side by side, s (default: the stack's)",
    )
    parser.add_argument(
        "--heartbeat-timeouts",
        default=None,
        help="the leader's heartbeat timeouts to run side by side on each lease, s, 0: off "
        "(default: the stack's, then 0; quick: the stack's alone)",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=2.0,
        help="seconds each cut node stays cut after the push (default 2; a longer cut "
        "shows what a return waits on connections left open across it)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each cluster's work dir (the daemons' and units' logs) after a clean run "
        "(its path goes to stderr)",
    )
    args = parser.parse_args()
    if not 0 <= args.hold <= 240:
        parser.error(f"--hold: seconds from 0 to 240 (Dynamo's lease is 300 s); got {args.hold:g}")
    stack = tomllib.loads(STACK.read_text())
    stock_ttl = int(stack["cluster"]["lease_ttl"])
    # what the router would take without dynamod: Dynamo's own lease (its default 30 s)
    dynamo_lease_s = float(stack["vars"].get("dynamo_lease_ttl", 30))
    stock_beat = float(stack["cluster"].get("heartbeat_timeout", 0))
    try:
        leases = [int(x) for x in (args.leases or str(stock_ttl)).split(",")]
        if any(x < 1 for x in leases):
            raise ValueError
    except ValueError:
        parser.error(f"--leases: whole seconds of at least 1, e.g. 2,1; got {args.leases!r}")
    default = f"{stock_beat:g}" if args.quick else f"{stock_beat:g},0"
    try:
        beats = [float(x) for x in (args.heartbeat_timeouts or default).split(",")]
        if any(not (x == 0 or 0.6 <= x <= 60) for x in beats):
            raise ValueError
    except ValueError:
        parser.error("--heartbeat-timeouts: 0 (off) or seconds from 0.6 to 60, e.g. 1.2,0; "
                     f"got {args.heartbeat_timeouts!r}")  # fmt: skip
    exit_on_signals()  # a stopped run stops its cluster and removes its namespaces
    # the harness logs (sandbox up, cut, heal) go to stderr: stdout is the report
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    report = Report("cluster", "Node loss and return on a 3-node cluster", args.quick)
    reason = can_create_namespaces()
    if reason is not None:
        report.notes.append(f"not run: {reason}")
        emit(report, args.json)
        return
    rounds = 1 if args.quick else 3
    load_at_start = os.getloadavg()
    load = Load(clients=3, rate=6, trainer_fraction=0.5, max_tokens=4, request_timeout=10)
    runs = [
        run_rounds(ttl, beat, rounds, load, args.hold, args.keep)
        for ttl in leases
        for beat in beats
    ]
    load_at_end = os.getloadavg()
    table = Table(
        "Per round: a worker node's link cut under load, a push during the cut, the link back",
        [
            "registry lease s",
            "heartbeat timeout s",
            "round",
            "node",
            "lost after s",
            "lost by",
            "router dropped it after s",
            "push s",
            "admitted at new version after heal s",
            "its etcd connections reopened",
            "requests",
            "failed before re-route",
            "failed after re-route (require current)",
            "refused at the outgoing version during the push",
            "nodes marked lost that were not cut",
        ],
        digits=2,
    )
    for results, info in runs:
        for k, r in enumerate(results, 1):
            table.rows.append(
                [
                    info["lease_ttl"],
                    info["heartbeat_timeout"] or "off",
                    k,
                    r.node,
                    r.lost_s,
                    lost_by(r.lost_why),
                    r.rerouted_s,
                    r.push_s,
                    r.admitted_s,
                    "yes" if r.link_back else "no",
                    len(r.requests),
                    len(r.failed_during_cut()),
                    len(r.failed_after_reroute()),
                    len(r.refused_at_outgoing_version()),
                    len(r.falsely_lost()),
                ]
            )
    report.tables.append(table)
    side = Table(
        "Side by side",
        [
            "registry lease s",
            "heartbeat timeout s",
            "router dropped the node, worst round s",
            "/ registry lease",
            f"/ Dynamo's own lease ({dynamo_lease_s:.0f} s)",
        ],
        digits=2,
    )
    for results, info in runs:
        worst = max(r.rerouted_s for r in results if r.rerouted_s is not None)
        ttl, beat = info["lease_ttl"], info["heartbeat_timeout"]
        side.rows.append([ttl, beat or "off", worst, worst / ttl, worst / dynamo_lease_s])
        what = ", ".join(
            ([] if ttl == stock_ttl else [f"a {ttl} s registry lease"])
            + ([] if beat == stock_beat else [f"heartbeats {f'at {beat:g} s' if beat else 'off'}"])
        )
        what = f", {what}" if what else ""
        report.target(  # issue 26's (issue 14's were 3 s and 10 s)
            f"cut -> router stops using the node's shards (worst round{what})",
            worst,
            2.0,
            "s",
        )
        report.target(
            f"link back -> shards admitted at the current version (worst round{what})",
            max(r.admitted_s for r in results if r.admitted_s is not None),
            5.0,
            "s",
        )
        report.target(
            f"failed requests requiring the current version after re-routing{what}",
            sum(len(r.failed_after_reroute()) for r in results),
            0,
            "requests",
        )
        report.target(
            f"nodes falsely marked lost (not cut, or twice) under load{what}",
            sum(len(r.falsely_lost()) for r in results),
            0,
            "nodes",
        )
    report.tables.append(side)
    report.data = {
        "runs": [
            {
                **info,
                "rounds": [
                    {
                        "node": r.node,
                        "lost_s": r.lost_s,
                        "lost_why": r.lost_why,
                        "rerouted_s": r.rerouted_s,
                        "push_s": r.push_s,
                        "admitted_s": r.admitted_s,
                        "link_back": r.link_back,
                        "requests": len(r.requests),
                        "failed_before_reroute": len(r.failed_during_cut()),
                        "marked_lost": r.marked_lost,
                        "failed_after_reroute": [vars(q) for q in r.failed_after_reroute()],
                    }
                    for r in results
                ],
                "median_rerouted_s": statistics.median(
                    r.rerouted_s for r in results if r.rerouted_s is not None
                ),
            }
            for results, info in runs
        ],
        "load_average_start": load_at_start,
        "load_average_end": load_at_end,
    }
    report.notes.append(
        "load average (1/5/15 min) at the start "
        + "/".join(f"{x:.2f}" for x in load_at_start)
        + ", at the end "
        + "/".join(f"{x:.2f}" for x in load_at_end)
        + (
            ": provisional, re-run on a quiet machine"
            if max(load_at_start[0], load_at_end[0]) > 1
            else ""
        )
    )
    for _, info in runs:
        report.notes.append(
            f"lease {info['lease_ttl']} s, heartbeat timeout "
            f"{info['heartbeat_timeout'] or 'off'}, each cut held {info['hold_s']:g} s after "
            f"the push: cluster up in {info['up_s']:.1f}s; "
            f"down --cluster in {info['down_cluster_s']:.1f}s (exit "
            f"{info['down_cluster_rc']}); leftovers: {info['close_problems'] or 'none'}"
        )
    report.notes.append(
        "Without heartbeats detection is bounded below by the registry lease: a cut node's "
        "entry expires between 2/3 and 1 lease_ttl after the cut (kept alive every ttl/3), "
        "plus up to 0.5 s until etcd's lessor revokes it. With them the leader revokes that "
        "lease once the node has not answered for heartbeat_timeout (pinged every 0.2 s; "
        "cluster/heartbeat.py). Either way the leader's registry watch sees the delete at "
        "once, withdraws the node's Dynamo instance keys and the router drops them within "
        "milliseconds. Back, the node puts the keys back (its shards paused) and replays. "
        f"The {stock_ttl} s lease and {stock_beat:g} s heartbeat timeout are the stack's; a 1 "
        f"s lease needs etcd's election timeout at {ELECTION_TIMEOUT_MS[1]} ms (set here), "
        "and a daemon that cannot keep its lease alive for ~0.7 s is marked lost."
    )
    emit(report, args.json)


if __name__ == "__main__":
    main()
