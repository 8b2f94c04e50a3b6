"""bench.fleet's stack: units/stacks/cluster.toml with its etcd as a replicated store of
up to 3 members (the first nodes), every etcd client of the stack (Dynamo's processes,
dynamod's registry, the policy ledger) given every member; and bench.cluster's, the stock
file on a registry lease of another length. Pure text in, text out: the stock file keeps
its one member on the head (the node-loss tests and bench.cluster)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

MAX_MEMBERS = 3
# etcd grants no lease shorter than 1.5 election timeouts, rounded up to whole seconds: with
# its default 1000 ms election timeout a 1 s lease is granted as 2 s. A 1 s registry lease
# needs the election timeout at 600 ms or less (heartbeat 100 ms, etcd's default).
ELECTION_TIMEOUT_MS = {1: 600}


class StackShapeError(ValueError):
    """The stock cluster stack no longer has a line this rewrite expects."""


def _one(pattern: str, text: str, new: str, what: str) -> str:
    changed, count = re.subn(pattern, lambda m: m.expand(new), text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise StackShapeError(f"units/stacks/cluster.toml: no {what} line to rewrite")
    return changed


def members(nodes: Sequence[str]) -> list[str]:
    """The nodes that run an etcd member: the first 3, or the head alone below 3 nodes (2
    members lose their quorum with either one, and the benchmark cuts a node)."""
    return list(nodes[:MAX_MEMBERS]) if len(nodes) >= MAX_MEMBERS else list(nodes[:1])


def replicated(text: str, nodes: Sequence[str], units_dir: Path, relay: bool = True) -> str:
    """`text` (cluster.toml) with etcd on `members(nodes)`, its includes made absolute
    (the result is written outside units/). With several members, Dynamo's processes reach
    them as the stock replicated stack's do (units/stacks/cluster-ha.toml): through each
    node's etcd relay on 127.0.0.1, never given the members' list. Given it, Dynamo 1.6.1
    keeps a share of its calls on a member that is cut off: a cut of a node that held a
    member kept the head's frontend routing to that node's shards 2-8 s after dynamod had
    withdrawn them (their registrations' deletes did not reach its watch). `relay=False`:
    Dynamo's processes given the members' list as before the relay (bench.fleet's
    `--direct-etcd`, to time what the relay's hop costs where no member fails)."""
    members_ = members(nodes)
    urls = ",".join(f"http://{{cluster.nodes.{m}}}:{{vars.etcd_client_port}}" for m in members_)
    initial = ",".join(f"{m}=http://{{cluster.nodes.{m}}}:{{ports.peer}}" for m in members_)
    text = text.replace('"../', f'"{units_dir}/')
    text = _one(r"^etcd_url = .*$", text, f'etcd_url = "{urls}"', "vars.etcd_url")
    if len(members_) > 1 and relay:
        text = _through_relay(text, urls, units_dir)
    text = _one(
        r'^(description = "etcd on \{node\.name\}.*)$',
        text,
        "\\g<0>\nnodes = [" + ", ".join(f'"{m}"' for m in members_) + "]",
        "units.etcd description",
    )
    text = _one(
        r'^    "--initial-cluster", .*$', text, f'    "--initial-cluster", "{initial}",',
        "etcd --initial-cluster",
    )  # fmt: skip
    registry = ", ".join(
        f'"http://{{cluster.nodes.{m}}}:{{vars.etcd_client_port}}"' for m in members_
    )
    return _one(r"^head = .*$", text, f"\\g<0>\nregistry = [{registry}]", "cluster.head")


def _through_relay(text: str, urls: str, units_dir: Path) -> str:
    """Dynamo's processes (the workers' and the frontend's ETCD_ENDPOINTS) on the node's
    etcd relay (units/cluster/etcd-relay.toml), each started once it is ready; dynamod's
    own clients keep the members' list (`vars.etcd_url`)."""
    relay_file = f'"{units_dir}/cluster/etcd-relay.toml"'
    text = _one(r"^include = \[(.*)\]$", text, f"include = [\\1, {relay_file}]", "stack include")
    relay = 'dynamo_etcd_url = "http://127.0.0.1:{vars.etcd_relay_port}"'
    text = _one(r"^etcd_url = .*$", text, f'\\g<0>\netcd_urls = "{urls}"\n{relay}',
                "vars.etcd_url")  # fmt: skip
    text, count = re.subn(r'ETCD_ENDPOINTS = "\{vars\.etcd_url\}"',
                          'ETCD_ENDPOINTS = "{vars.dynamo_etcd_url}"', text)  # fmt: skip
    if count != 2:
        raise StackShapeError("units/stacks/cluster.toml: not 2 ETCD_ENDPOINTS (worker, frontend)")
    for unit, rest in (("worker", 'model = "completed"'), ("frontend", 'worker = "started"')):
        text = _one(rf'^depends_on = \{{ etcd = "ready", (nats = "ready", {rest} \}})$', text,
                    'depends_on = { etcd = "ready", etcd-relay = "ready", \\1',
                    f"units.{unit} depends_on")  # fmt: skip
    return text


def with_lease(text: str, lease_ttl: int, units_dir: Path) -> str:
    """`text` (cluster.toml) on a registry lease of `lease_ttl` s, with the etcd election
    timeout that etcd needs to grant a lease that short, its includes made absolute."""
    text = text.replace('"../', f'"{units_dir}/')
    text = _one(r"^(lease_ttl\s*=\s*)[0-9.]+", text, f"\\g<1>{lease_ttl}", "cluster.lease_ttl")
    if lease_ttl not in ELECTION_TIMEOUT_MS:
        return text
    return _etcd_flag(text, "--election-timeout", str(ELECTION_TIMEOUT_MS[lease_ttl]))


def with_etcd_metrics(text: str, level: str | None) -> str:
    """`text` (cluster.toml) with every etcd member's `--metrics` at `level` ("extensive"
    adds gRPC's per-call histograms: what etcd's server spent on each transaction);
    unchanged for None."""
    if level is None:
        return text
    return _etcd_flag(text, "--metrics", level)


def _etcd_flag(text: str, flag: str, value: str) -> str:
    """`text` (cluster.toml) with `flag value` in etcd's command, after its
    `--initial-cluster`."""
    line = f'    "{flag}", "{value}",'
    return _one(r'^    "--initial-cluster", .*$', text, f"\\g<0>\n{line}", "etcd --initial-cluster")


def with_heartbeat(text: str, timeout: float | None) -> str:
    """`text` (cluster.toml) with the leader's heartbeat timeout at `timeout` s (0: off;
    cluster/heartbeat.py); unchanged for None."""
    if timeout is None:
        return text
    return _one(r"^(heartbeat_timeout\s*=\s*)[0-9.]+", text, f"\\g<1>{timeout:g}",
                "cluster.heartbeat_timeout")  # fmt: skip


def with_shard_live_timeout(text: str, timeout: float | None) -> str:
    """`text` (cluster.toml) with the shards' liveness probe given `timeout` s to answer
    (the stack's is 2 s); unchanged for None."""
    if timeout is None:
        return text
    return _one(
        r'^(live = \{ kind = "http", method = "POST", url = "[^"]*/engine/liveness_probe"'
        r".*timeout = )[0-9.]+(.*)$",
        text,
        f"\\g<1>{timeout:g}\\g<2>",
        "units.worker live",
    )


def with_shard_limits(text: str, limits: dict[str, int]) -> str:
    """`text` (cluster.toml) with every shard under `limits` (`{ cpu_weight = 20 }`,
    `{ nice = 10 }`); unchanged for none."""
    if not limits:
        return text
    table = ", ".join(f"{name} = {value}" for name, value in limits.items())
    return _one(
        r'^(\[units\.worker\]\ndescription = .*)$', text,
        f"\\g<0>\nlimits = {{ {table} }}", "units.worker",
    )  # fmt: skip


def with_max_starting(text: str, max_starting: int | None) -> str:
    """`text` (cluster.toml) with `[stack] max_starting` set: each node's daemon starts at
    most that many of its units at once; unchanged for None."""
    if max_starting is None:
        return text
    return _one(r"^\[stack\]$", text, f"\\g<0>\nmax_starting = {max_starting}", "[stack]")


def with_max_updating(text: str, max_updating: int | None) -> str:
    """`text` (cluster.toml) with `[policy] max_updating` set: each node's daemon lets at most
    that many of its shards apply an update at once; unchanged for None."""
    if max_updating is None:
        return text
    return _one(r"^\[policy\]$", text, f"\\g<0>\nmax_updating = {max_updating}", "[policy]")


def with_modeled_reset(text: str, seconds: float | None) -> str:
    """`text` (cluster.toml) with every shard's engine reset modeled as `seconds` off the
    CPU (the CPU worker's `--modeled-reset-s`, mocker only); unchanged for None."""
    if seconds is None:
        return text
    return _one(
        r'^(    "--engine", "\{vars\.worker_engine\}",)$', text,
        f'\\g<1>\n    "--modeled-reset-s", "{seconds:g}",', "units.worker --engine",
    )  # fmt: skip
