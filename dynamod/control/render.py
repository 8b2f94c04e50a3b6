"""Human output: the status tree and the progress lines `up` prints while it waits."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from dynamod.core.status import UnitStatus


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _tree_lines(units: Sequence[UnitStatus]) -> list[tuple[str, UnitStatus]]:
    """Units nothing depends on are roots; each unit's children are its dependencies.
    A unit already shown appears again with a trailing '^', its state only, no children."""
    by_name = {u["name"]: u for u in units}
    depended_on = {dep for u in units for dep in u["depends_on"]}
    roots = [u for u in units if u["name"] not in depended_on]
    lines: list[tuple[str, UnitStatus]] = []
    shown: set[str] = set()

    def walk(row: UnitStatus, prefix: str, last: bool, top: bool) -> None:
        branch = "" if top else ("└─ " if last else "├─ ")
        seen = row["name"] in shown
        lines.append((prefix + branch + row["name"] + (" ^" if seen else ""), row))
        if seen:
            return
        shown.add(row["name"])
        deps = [by_name[d] for d in row["depends_on"] if d in by_name]
        child_prefix = prefix + ("" if top else ("   " if last else "│  "))
        for i, dep in enumerate(deps):
            walk(dep, child_prefix, i == len(deps) - 1, False)

    for root in roots:
        walk(root, "", True, True)
    return lines


def status_table(status: Mapping[str, Any]) -> str:
    units: list[UnitStatus] = status["units"]
    header = ["UNIT", "STATE", "PID", "UPTIME", "RESTARTS", "LAST EXIT", "DETAIL"]
    rows = []
    for label, unit in _tree_lines(units):
        if label.endswith(" ^"):  # shown in full further up
            rows.append([label, unit["state"], "", "", "", "", ""])
            continue
        rows.append(
            [
                label,
                _state(unit),
                str(unit["pid"] or "-"),
                duration(unit["uptime_s"]),
                str(unit["restarts"]),
                unit["last_exit"] or "-",
                _detail(unit),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    out = [
        f"stack {status['stack']} ({status['phase']}) — daemon pid {status['daemon_pid']}, "
        f"state dir {status['state_dir']}"
    ]
    if status.get("containment"):
        out.append(f"containment: {status['containment']['summary']}")
    if status.get("web"):
        out.append(f"status page: {status['web']['url']}")
    guardian = status.get("guardian")
    if guardian and guardian.get("restarts"):
        out.append(
            f"guardian: pid {guardian['pid']}, restarted {guardian['restarts']} time(s) "
            f"(last: {guardian['last_death']})"
        )
    if status.get("error"):
        out.append(f"error: {status['error']}")
    if status.get("logs"):
        out.append(
            f"logs: {_megabytes(status['logs']['dropped_bytes'])} dropped, "
            f"{status['logs']['reason']}"
        )
    for warning in status.get("exposure") or []:
        out.append(f"warning: {warning}")
    out += slot_lines(status)
    degraded = status.get("degraded") or {}
    if degraded:
        out.append("degraded: " + "; ".join(f"{name} {why}" for name, why in degraded.items()))
    out += identity_lines(status.get("identity") or {})
    for row in [header, *rows]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        out.append("  ".join([*cells, row[-1]]).rstrip())
    out += limits_lines(units)
    if status.get("cluster"):
        out += cluster_tree(status["cluster"])
    return "\n".join(out)


def identity_lines(identity: Mapping[str, Any]) -> list[str]:
    """A Dynamo namespace shared with other stacks' workers (rollout/identity.py), other
    stacks hidden from this one (etcd's auth: then no sharing can be seen), and an identity
    another daemon took first."""
    lines = []
    for namespace, shared in (identity.get("shared_namespaces") or {}).items():
        lines.append(
            f"degraded: Dynamo namespace {namespace!r} is shared with {shared['workers']} "
            f"worker(s) of {'; '.join(shared['stacks'])} (the frontends of both stacks may "
            "route to the other's workers)"
        )
    if identity.get("others_visible") is False:
        lines.append(
            "note: other stacks' daemons are hidden from this stack's etcd user (etcd auth): "
            "a Dynamo namespace shared with another stack is not detected, and the start-up "
            "sweep revokes only registrations this stack recorded"
        )
    if identity.get("refused"):
        lines.append(f"identity not held: {identity['refused']}")
    return lines


def slot_lines(status: Mapping[str, Any]) -> list[str]:
    """A line for each bounded line that has units waiting: `[stack] max_starting`'s starts,
    `[policy] max_updating`'s shard updates; and the shards a push answered early left
    updating."""
    out = []
    for title, slots, setting, doing in (
        ("start slots", status.get("start_slots"), "max_starting", "starting"),
        ("update slots", (status.get("policy") or {}).get("update_slots"), "max_updating",
         "updating"),
    ):  # fmt: skip
        if slots and slots["waiting"]:
            out.append(
                f"{title}: {len(slots[doing])} of {setting} {slots[setting]} in use "
                f"({', '.join(slots[doing])}); waiting: {', '.join(slots['waiting'])}"
            )
    policy = status.get("policy") or {}
    if policy.get("updating"):  # a push answered early (`policy push --serving K`)
        out.append(
            f"policy v{policy.get('current')}: answered early, still updating (no trainer "
            f"traffic until they serve it): {', '.join(policy['updating'])}"
        )
    if policy.get("paused_outside"):  # verl paused them itself (rollout/pause_claims.py)
        out.append(
            "paused outside dynamod (served again when dynamod or the pauser resumes them, "
            f"rejoined if the pauser exits first): {', '.join(policy['paused_outside'])}"
        )
    return out


def limits_lines(units: Sequence[UnitStatus]) -> list[str]:
    """Each unit with limits: every limit with how this host enforces it, and its OOM kills."""
    out = []
    for unit in units:
        limits = unit.get("limits")
        if not limits:
            continue
        ooms = limits["oom_kills"]
        out.append(
            f"limits {unit['name']} ({limits['mechanism']}): "
            + "; ".join(f"{name} {how}" for name, how in limits["limits"].items())
            + (f"; OOM-killed {ooms} time(s)" if ooms else "")
        )
    return out


def cluster_tree(cluster: Mapping[str, Any]) -> list[str]:
    """The cluster tree: node -> its units, from the registry (every node's own entry)."""
    out = [
        "",
        f"cluster: this node {cluster['this_node']}, head {cluster['head']}, leader "
        f"{cluster.get('leader') or '-'}, policy v{cluster.get('policy_current')}",
    ]
    if cluster.get("error"):
        out.append(f"registry error (this view may be stale): {cluster['error']}")
    if cluster.get("behind"):
        out.append("behind the current policy version: " + ", ".join(cluster["behind"]))
    rows: list[list[str]] = [["NODE / UNIT", "STATE", "PID", "POLICY", "DETAIL"]]
    nodes = cluster["nodes"]
    for n, node in enumerate(nodes):
        last_node = n == len(nodes) - 1
        role = " (head)" if node["head"] else ""
        detail = node["address"]
        if node.get("lost"):
            lost = node["lost"]
            detail += (
                f"  {lost.get('why') or 'its registry lease expired'}; shards "
                f"{', '.join(lost['shards']) or '-'} marked lost by "
                f"{lost['by']}, registrations revoked: {', '.join(lost['revoked']) or 'none'}"
            )
        if node.get("forgotten"):
            gone = node["forgotten"]
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gone["at"]))
            detail += f"  gone for good, said on {gone['by']} at {when} (`dynamod cluster forget`)"
        rows.append(
            [
                f"{'└─' if last_node else '├─'} {node['name']}{role}",
                node["state"],
                str(node.get("daemon_pid") or "-"),
                "",
                detail,
            ]
        )
        units = node["units"]
        for u, unit in enumerate(units):
            stem = "   " if last_node else "│  "
            branch = "└─" if u == len(units) - 1 else "├─"
            version = unit.get("policy_version")
            rows.append(
                [
                    f"{stem}{branch} {unit['name']}",
                    unit["state"],
                    str(unit.get("pid") or "-"),
                    f"v{version}" if version is not None else "",
                    unit.get("detail", ""),
                ]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        out.append("  ".join([*cells, row[-1]]).rstrip())
    return out


def down_report(result: Mapping[str, Any]) -> list[str]:
    """What `down` had to kill, what it could not, and the verdict."""
    lines = []
    if result.get("containment"):
        lines.append(f"containment: {result['containment']}")
    killed: Mapping[str, Sequence[int]] = result.get("killed") or {}
    total = sum(len(pids) for pids in killed.values())
    if total:
        where = ", ".join(f"{name}: {' '.join(map(str, pids))}" for name, pids in killed.items())
        lines.append(f"had to kill {total} process(es) (SIGKILL / cgroup.kill): {where}")
    else:
        lines.append("had to kill nothing: every process ended on its stop signal")
    if result["survivors"]:
        lines.append(f"COULD NOT KILL {len(result['survivors'])}: {result['survivors']}")
    verdict = "nothing left running" if result["ok"] else f"SURVIVORS {result['survivors']}"
    lines.append(f"stack down in {result['seconds']:.2f}s: {verdict}")
    return lines


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.1f} MB"


def _state(unit: UnitStatus) -> str:
    """A hot spare is ready but not in service: its own role in the STATE column."""
    spare = unit.get("spare")
    if unit["state"] == "ready" and spare is not None and spare.get("role") == "spare":
        return "spare (asleep)" if spare.get("sleeping") else "spare"
    return str(unit["state"])


def _detail(unit: UnitStatus) -> str:
    parts = []
    if unit.get("ports"):
        parts.append(" ".join(f"{k}={v}" for k, v in unit["ports"].items()))
    dynamo = unit.get("dynamo")
    if dynamo is not None:
        ids = dynamo.get("instance_ids") or []
        if ids:
            parts.append("instance " + ",".join(f"{i:x}" for i in ids))
        if dynamo.get("routed") is not None:
            parts.append("routed" if dynamo["routed"] else "NOT routed")
    policy = unit.get("policy")
    if policy is not None and "version" in policy:
        parts.append(f"policy v{policy['version']} (current {policy.get('current')})")
        if policy.get("routed_version") is not None:  # a canary proved the router routes it
            parts.append(f"router-verified v{policy['routed_version']}")
    for claim in (policy.get("paused_by") or []) if policy is not None else []:  # verl's
        parts.append(f"PAUSED by pid {claim['pid']} ({claim['why']}) for {claim['for_s']:.0f}s")
    detail = unit.get("detail") or ""
    if detail:
        parts.append(detail.splitlines()[0][:120])
    if unit.get("cause"):
        parts.append(f"cause: {unit.get('cause')}")
    return "  ".join(parts)


LONG_WAIT = 60.0
LONG_WAIT_EVERY = 15.0


class Progress:
    """Turns successive status snapshots into lines worth printing while `up` waits."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self._states: dict[str, str] = {}
        self._last_summary = -1e9

    def update(self, status: Mapping[str, Any], now: float) -> list[str]:
        lines = []
        for unit in status["units"]:
            name, state = unit["name"], unit["state"]
            if self._states.get(name) != state:
                self._states[name] = state
                if state == "inactive":
                    continue
                pid = f" pid {unit['pid']}" if unit["pid"] else ""
                lines.append(f"  {name:<16} {state}{pid}  {_first_line(unit['detail'])}")
        waiting = [u for u in status["units"] if u["state"] in {"starting", "backoff", "held"}]
        # Every `every` seconds while the waits are short; a wait of minutes (a real engine
        # loading) is reported every LONG_WAIT_EVERY seconds instead of filling the screen.
        longest = max((u.get("since_s") or 0.0 for u in waiting), default=0.0)
        every = self.every if longest < LONG_WAIT else max(self.every, LONG_WAIT_EVERY)
        if now - self._last_summary >= every:
            self._last_summary = now
            for unit in waiting:
                lines.append(
                    f"  … {unit['name']} {unit['state']} for {duration(unit['since_s'])}: "
                    f"{_first_line(unit['detail'])}"
                )
        return lines


def _first_line(text: str | None) -> str:
    return (text or "").splitlines()[0][:160] if text else ""
