"""Checkers over a recorded history, as Jepsen does: pure functions from what was recorded
(requests, state changes, versions, teardown) and a bound to a verdict with the measured
values. No I/O here; each one is tested with histories that must pass and that must fail."""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynamod.chaos.history import History, PortTake
from dynamod.chaos.model import Invariant


@dataclass(frozen=True)
class Verdict:
    check: str
    ok: bool
    detail: str
    measured: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "detail": self.detail,
                "measured": self.measured}


def shards_current(history: History, inv: Invariant) -> Verdict:
    """After recovery every admitted shard is at the ledger's current version."""
    status = history.final_status
    if not status or "policy" not in status:
        return Verdict(inv.check, False, "no final status with a policy section was recorded")
    current = status["policy"].get("current")
    shards = {u["name"]: u for u in status["units"] if "policy_version" in u}
    admitted = {n: u for n, u in shards.items() if (u.get("policy") or {}).get("admitted")}
    behind = {n: u.get("policy_version") for n, u in admitted.items()
              if u.get("policy_version") != current}
    # Asked of the shard itself, where it answered: dynamod's claim is not enough.
    engine = {n: u["engine"].get("version") for n, u in admitted.items()
              if isinstance(u.get("engine"), dict) and "version" in u["engine"]}
    behind |= {n: f"{v} (the shard says)" for n, v in engine.items() if v != current}
    measured = {"current": current, "shards": {n: u.get("policy_version") for n, u in
                                               shards.items()}, "admitted": sorted(admitted),
                "engine_versions": engine}
    if not admitted:
        return Verdict(inv.check, False, f"no shard is admitted (current {current})", measured)
    if behind:
        return Verdict(inv.check, False, f"admitted shards behind version {current}: "
                       + ", ".join(f"{n} at {v}" for n, v in sorted(behind.items())), measured)
    missing = sorted(set(shards) - set(admitted))
    note = f"; not admitted: {', '.join(missing)}" if missing else ""
    return Verdict(inv.check, True, f"{len(admitted)} admitted shards at version {current}{note}",
                   measured)


def no_stale_serving(history: History, inv: Invariant) -> Verdict:
    """No completion served below the version it required, nor below the ledger's version
    current `grace` seconds before it was sent (the update boundary has passed)."""
    changes = history.ledger_changes()
    times = [t for t, _ in changes]

    def current_at(t: float) -> int | None:
        i = bisect.bisect_right(times, t) - 1
        return changes[i][1] if i >= 0 else None

    served = [r for r in history.requests if r.ok]
    if not served:
        return Verdict(inv.check, False, "no completion was served: nothing to judge")
    unstamped = [r for r in served if r.version is None]
    stale = []
    for r in served:
        if r.version is None:
            continue
        floor = current_at(r.sent - inv.grace)
        need = max(v for v in (floor, r.required, -1) if v is not None)
        if r.version < need:
            stale.append((r, need))
    measured = {"served": len(served), "stale": len(stale), "unstamped": len(unstamped),
                "unstamped_trainer": sum(r.required is not None for r in unstamped),
                "boundaries": [[round(t, 3), v] for t, v in changes]}
    if unstamped:
        return Verdict(inv.check, False, f"{len(unstamped)} of {len(served)} completions "
                       "served by a stale shard: they carry no weight version (engine_data "
                       "missing, or the shard declared none)", measured)
    if stale:
        r, need = stale[0]
        return Verdict(inv.check, False, f"{len(stale)} of {len(served)} completions served by "
                       f"a stale shard; first: sent at {r.sent:.2f}s, served by {r.instance} at "
                       f"version {r.version}, current was {need}", measured)
    return Verdict(inv.check, True, f"{len(served)} completions, none stale "
                   f"({len(changes)} ledger versions seen)", measured)


def client_errors(history: History, inv: Invariant) -> Verdict:
    """Failed requests stay within `max_errors` and/or `max_error_rate`, over all requests
    or only the plain or the trainer-style (taint-constrained) ones."""
    requests = [r for r in history.requests if inv.traffic == "all"
                or (r.required is None) == (inv.traffic == "plain")]
    total = len(requests)
    failed = [r for r in requests if not r.ok]
    rate = len(failed) / total if total else 0.0
    by_status: dict[str, int] = {}
    for r in failed:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    measured = {"traffic": inv.traffic, "requests": total, "errors": len(failed),
                "rate": round(rate, 4), "by_status": by_status}
    if total == 0:
        return Verdict(inv.check, False, f"no {inv.traffic} requests were recorded", measured)
    bound_n = inv.max_errors if inv.max_errors is not None else total
    bound_r = inv.max_error_rate if inv.max_error_rate is not None else 1.0
    ok = len(failed) <= bound_n and rate <= bound_r
    first = f"; first: {failed[0].status} {failed[0].error or ''}"[:160] if failed else ""
    bounds = [f"at most {inv.max_errors}"] if inv.max_errors is not None else []
    bounds += [f"at most {bound_r:.1%}"] if inv.max_error_rate is not None else []
    return Verdict(inv.check, ok, f"{len(failed)} of {total} {inv.traffic} requests failed "
                   f"({rate:.1%}; bound {' and '.join(bounds) or 'none'}){first}", measured)


def _serving_gap(history: History, after: float) -> float | None:
    """Seconds from `after` until a request sent after it was served (None: never)."""
    ok = [r.done for r in history.requests if r.ok and r.sent >= after]
    return min(ok) - after if ok else None


_RECOVERED = ("ready", "completed")  # completed: it was started again and finished its work


def recovery_time(history: History, inv: Invariant) -> Verdict:
    """Every fault is recovered from within `max_seconds`: a unit fault once the unit is
    ready again after it left ready (or, a unit that runs to an end such as the trainer,
    once it ran again and completed: a resumed trainer with little left to do may finish
    before it counts as ready); any fault once a request sent after the heal is served."""
    if not history.faults:
        return Verdict(inv.check, False, "no fault was recorded: nothing recovered")
    bound = inv.max_seconds if inv.max_seconds is not None else float("inf")
    rows: list[dict[str, Any]] = []
    worst = 0.0
    failures: list[str] = []
    for fault in history.faults:
        healed = fault.healed_at if fault.healed_at is not None else fault.at
        row: dict[str, Any] = {"fault": fault.name, "target": fault.target, "at": fault.at}
        if fault.target:
            after = [s for s in history.states if s.unit == fault.target and s.at >= fault.at]
            left = next((s for s in after if s.old == "ready"), None)
            back = next((s for s in after if left and s.at > left.at and s.new in _RECOVERED), None)
            if left is None:
                row["unit_s"] = 0.0
                row["note"] = "the unit never left ready"
            elif back is None:
                failures.append(f"{fault.target} never ready again after {fault.name}")
                row["unit_s"] = None
            else:
                row["unit_s"] = round(back.at - fault.at, 3)
        gap = _serving_gap(history, healed) if history.requests else 0.0
        row["serving_s"] = None if gap is None else round(gap, 3)
        if gap is None:
            failures.append(f"nothing served after {fault.name} healed")
        for key in ("unit_s", "serving_s"):
            if isinstance(row.get(key), int | float):
                worst = max(worst, row[key])
        rows.append(row)
    measured = {"faults": rows, "worst_s": round(worst, 3)}
    if failures:
        return Verdict(inv.check, False, "; ".join(failures), measured)
    return Verdict(inv.check, worst <= bound, f"worst recovery {worst:.2f}s (bound {bound}s)",
                   measured)


def no_leftovers(history: History, inv: Invariant) -> Verdict:
    """After `down`: no process, no bound port and no Dynamo registration left behind."""
    td = history.teardown
    if td is None:
        return Verdict(inv.check, False, "the teardown was not recorded")
    measured = {"alive_pids": td.alive_pids, "bound_ports": td.bound_ports,
                "stale_registrations": td.stale_registrations, "down_ok": td.down_ok}
    problems = []
    if not td.down_ok:
        problems.append(f"`down` failed: {td.down_output.strip()[-200:]}")
    if td.alive_pids:
        problems.append(f"processes left: {td.alive_pids}")
    if td.bound_ports:
        problems.append(f"ports still bound: {td.bound_ports}")
    if td.stale_registrations:
        problems.append(f"registrations of dead instances: {td.stale_registrations}")
    if problems:
        return Verdict(inv.check, False, "; ".join(problems), measured)
    return Verdict(inv.check, True, "nothing left behind", measured)


def trainer_progress(history: History, inv: Invariant) -> Verdict:
    """The ledger moved at least `min_versions` versions during the run."""
    changes = history.ledger_changes()
    start = history.start_version if history.start_version is not None else (
        changes[0][1] if changes else None)
    end = changes[-1][1] if changes else None
    measured = {"start": start, "end": end}
    if start is None or end is None:
        return Verdict(inv.check, False, "the ledger's version was never seen", measured)
    moved = end - start
    return Verdict(inv.check, moved >= inv.min_versions,
                   f"ledger went {start} -> {end} (at least {inv.min_versions} needed)", measured)


def cache_hit_recovers(history: History, inv: Invariant) -> Verdict:
    """After each update's warm-up boundary the prefix-cache hit rate is back to at least
    `min_fraction` of what it was before the update."""
    changes = history.ledger_changes()[1:]
    if not changes:
        return Verdict(inv.check, False, "no policy update happened: nothing to judge")
    if not history.cache:
        return Verdict(inv.check, False, "no cache hit-rate samples were recorded")
    rows = []
    failures = []
    for i, (at, version) in enumerate(changes):
        prev = changes[i - 1][0] if i else float("-inf")
        nxt = changes[i + 1][0] if i + 1 < len(changes) else float("inf")
        before = [c.hit_rate for c in history.cache if prev <= c.at < at]
        after = [c.hit_rate for c in history.cache if at + inv.warmup <= c.at < nxt]
        if not before or not after:
            failures.append(f"version {version}: no samples {'before' if not before else 'after'}")
            continue
        b, a = sum(before) / len(before), sum(after) / len(after)
        rows.append({"version": version, "before": round(b, 3), "after": round(a, 3)})
        if b <= 0:
            failures.append(f"version {version}: no cache hits before the update (rate 0)")
        elif a < inv.min_fraction * b:
            failures.append(f"version {version}: hit rate {a:.2f} after warm-up, "
                            f"below {inv.min_fraction:.0%} of {b:.2f}")
    measured = {"updates": rows}
    if failures:
        return Verdict(inv.check, False, "; ".join(failures), measured)
    return Verdict(inv.check, True, f"hit rate recovered after {len(rows)} updates", measured)


def up_fails_naming(history: History, inv: Invariant) -> Verdict:
    """`dynamod up` refused the stack (non-zero) with a diagnosis (its stderr) naming each
    of `names`."""
    measured = {"up_returncode": history.up_returncode, "names": inv.names}
    if history.up_returncode is None:
        return Verdict(inv.check, False, "`dynamod up` was not run", measured)
    if history.up_returncode == 0:
        return Verdict(inv.check, False, "`dynamod up` succeeded; it was meant to fail",
                       measured)
    missing = [n for n in inv.names if n not in history.up_output]
    if missing:
        return Verdict(inv.check, False, f"`dynamod up` failed ({history.up_returncode}) "
                       f"without naming {', '.join(missing)}; it said: "
                       f"{history.up_output.strip()[-300:]}", measured)
    return Verdict(inv.check, True, f"`dynamod up` failed ({history.up_returncode}) naming "
                   f"{', '.join(inv.names) or 'nothing asked'}", measured)


def token_alignment(history: History, inv: Invariant) -> Verdict:
    """Every terminal completion carries as many logprobs as token ids, and as many as the
    usage counts, so what a trainer consumes lines up with what the engine emitted.
    Terminal (finished: stop/length) and cancelled or failed attempts are counted apart."""
    terminal = [r for r in history.requests if r.ok and r.finish in ("stop", "length")]
    cancelled = [r for r in history.requests if r not in terminal]
    misaligned = [r for r in terminal if r.token_ids is None or r.logprobs is None
                  or r.token_ids != r.logprobs or r.usage_tokens != r.token_ids]
    measured = {"terminal": len(terminal), "cancelled_or_failed": len(cancelled),
                "misaligned": len(misaligned),
                "without_logprobs": sum(r.logprobs is None for r in terminal)}
    if not terminal:
        return Verdict(inv.check, False, "no terminal completion was recorded", measured)
    if misaligned:
        r = misaligned[0]
        return Verdict(inv.check, False, f"{len(misaligned)} of {len(terminal)} terminal "
                       f"completions misaligned; first: {r.token_ids} token ids, {r.logprobs} "
                       f"logprobs, usage {r.usage_tokens}", measured)
    return Verdict(inv.check, True, f"{len(terminal)} terminal completions aligned "
                   f"({len(cancelled)} cancelled or failed counted apart)", measured)


def _port_take_outcome(history: History, take: PortTake, bound: float) -> dict[str, Any]:
    """What dynamod said of one taken port within `bound` seconds: when it named the port
    and its owner, when the unit was ready on another port (and served), or a lie: ready
    again on the very port the chaos runner holds."""
    until = take.at + bound
    if take.released_at is not None:
        until = min(until, take.released_at)
    window = [s for s in take.seen if s.at <= until]
    owner = re.compile(rf"\b{take.owner_pid}\b")
    row: dict[str, Any] = {"unit": take.unit, "port": f"{take.port_name}={take.port}",
                           "owner": f"pid {take.owner_pid} ({take.owner})", "named_s": None,
                           "moved_s": None, "moved_to": None, "lie_s": None}
    left_ready = False
    for seen in window:
        if row["named_s"] is None and str(take.port) in seen.detail and owner.search(seen.detail):
            row["named_s"] = round(seen.at - take.at, 3)
        moved_to = seen.ports.get(take.port_name)
        if seen.state == "ready" and moved_to not in (None, take.port) and row["moved_s"] is None:
            served = [r for r in history.requests if r.ok and r.sent >= seen.at]
            if served or not history.requests:
                row["moved_s"], row["moved_to"] = round(seen.at - take.at, 3), moved_to
        if seen.state != "ready":
            left_ready = True
        elif left_ready and moved_to == take.port and row["lie_s"] is None:
            row["lie_s"] = round(seen.at - take.at, 3)
    last = window[-1] if window else None
    row["last"] = f"{last.state}: {last.detail[-200:]}" if last else "never seen"
    return row


def port_conflict_truthful(history: History, inv: Invariant) -> Verdict:
    """A port taken before its unit binds it again gets a truthful answer within
    `max_seconds`: an error naming the port and its owner's pid, or the unit serving on
    another port. Neither (a silent hang or endless retries) fails, and so does the unit
    reported ready on the port the chaos runner holds."""
    if not history.port_takes:
        return Verdict(inv.check, False, "no port was taken: nothing to judge")
    bound = inv.max_seconds if inv.max_seconds is not None else 20.0
    rows = [_port_take_outcome(history, take, bound) for take in history.port_takes]
    failures = []
    for row in rows:
        if row["lie_s"] is not None:
            failures.append(f"{row['unit']} reported ready on {row['port']} at +{row['lie_s']}s "
                            f"while {row['owner']} held it")
        elif row["named_s"] is None and row["moved_s"] is None:
            failures.append(f"{row['unit']}: within {bound:g}s neither an error naming "
                            f"{row['port']} and {row['owner']} nor serving on another port; "
                            f"last seen {row['last']}")
    measured = {"takes": rows, "bound_s": bound}
    if failures:
        return Verdict(inv.check, False, "; ".join(failures), measured)
    said = [f"{r['unit']}: " + (f"named {r['port']} and its owner after {r['named_s']}s"
                                if r["named_s"] is not None
                                else f"moved to {r['moved_to']}, serving after {r['moved_s']}s")
            for r in rows]
    return Verdict(inv.check, True, "; ".join(said), measured)


def none_paused(history: History, inv: Invariant) -> Verdict:
    """No shard dynamod admits is paused at the end (a pause whose pauser died is one
    nobody else will end), by its engine's own word (the CPU worker's liveness answer) or,
    where the engine does not say (dynamo.vllm), by a 1-token completion pinned to it that
    it did not answer in time (chaos.stack.Stack.ask_shards)."""
    status = history.final_status
    if not status:
        return Verdict(inv.check, False, "no final status was recorded")
    admitted = {u["name"]: u for u in status["units"]
                if "policy_version" in u and (u.get("policy") or {}).get("admitted")}  # fmt: skip
    told = {n: bool(u["engine"]["paused"]) for n, u in admitted.items()
            if isinstance(u.get("engine"), dict) and "paused" in u["engine"]}  # fmt: skip
    seen = {n: admitted[n]["engine"].get("paused_seen", "liveness") for n in told}
    claimed = (status.get("policy") or {}).get("paused_outside") or []
    measured = {"admitted": sorted(admitted), "engine_paused": told, "seen": seen,
                "paused_outside": claimed}  # fmt: skip
    if not told:
        return Verdict(inv.check, False, "no admitted shard's engine says whether it is paused, "
                       "and none answered a pinned completion either way: nothing to judge",
                       measured)  # fmt: skip
    paused = sorted(n for n, p in told.items() if p)
    if paused:
        why = f" (claimed by a live pauser: {', '.join(claimed)})" if claimed else ""
        named = ", ".join(f"{n} ({seen[n]})" for n in paused)
        return Verdict(inv.check, False, f"admitted shards paused: {named}{why}", measured)
    return Verdict(inv.check, True, f"{len(told)} admitted shards, none paused", measured)


CHECKERS: dict[str, Callable[[History, Invariant], Verdict]] = {
    "shards_current": shards_current,
    "no_stale_serving": no_stale_serving,
    "client_errors": client_errors,
    "recovery_time": recovery_time,
    "no_leftovers": no_leftovers,
    "trainer_progress": trainer_progress,
    "cache_hit_recovers": cache_hit_recovers,
    "up_fails_naming": up_fails_naming,
    "token_alignment": token_alignment,
    "port_conflict_truthful": port_conflict_truthful,
    "none_paused": none_paused,
}


def judge(history: History, invariants: list[Invariant]) -> list[Verdict]:
    return [CHECKERS[inv.check](history, inv) for inv in invariants]
