"""Runs runbooks end to end: up the stack on a fresh state dir, check the steady state,
start the load and the observer, perform the method (abort conditions checked between
steps, within the profile's time bound), then always: rollbacks and the final heal, the
steady state again, the leftover search, the checkers over the whole recorded history, and
the journal, the history and the timeline written to the run's folder. Runbooks of one
group (`groups`: the same stack, vars and env, each allowing it) share one started stack:
the next one starts once its steady state holds again, the leftover search between them
looks at the live stack (dead units' processes, registrations of dead instances), and the
group's last runbook judges the `down`. A runbook that leaves the steady state broken
hands the next one a fresh stack."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from dynamod.chaos import checkers, faults, steady
from dynamod.chaos.history import History, Teardown
from dynamod.chaos.journal import Activity, Journal, RunStatus, timed
from dynamod.chaos.load import LoadGenerator
from dynamod.chaos.model import Probe, Profile, Runbook, Step
from dynamod.chaos.observer import Observer, states_from_log
from dynamod.chaos.stack import Stack
from dynamod.chaos.timeline import draw


class Aborted(Exception):
    """An abort condition of the runbook held."""


class _Done(Exception):
    """Nothing more to run (the stack was meant not to come up)."""


_OPERATOR_STOP = "interrupted by the operator"


class UpRefused(Exception):
    """`dynamod up` exited non-zero (what a runbook may expect)."""


def _up(stack: Stack, timeout: float, seen: dict[str, object]) -> str:
    result = stack.up(timeout=timeout)
    # the diagnosis is what `up` says on stderr; its stdout is progress that names every unit
    seen.update(returncode=result.returncode, output=result.stderr)
    if result.returncode != 0:
        raise UpRefused(f"dynamod up exited {result.returncode}: "
                        f"{(result.stderr or result.stdout).strip()[-1500:]}")
    return result.stdout.strip()[-300:]


def _probe_activities(stack: Stack, runbook: Runbook, until: float) -> list[Activity]:
    """The steady-state probes, each retried up to its timeout but all within `until`."""
    acts = []
    for probe in runbook.steady_state:
        def one(p: Probe = probe) -> str:
            left = max(1.0, until - time.monotonic())
            ok, seen = steady.check(stack, p.model_copy(update={"timeout": min(p.timeout, left)}))
            if not ok:
                raise AssertionError(seen)
            return seen

        acts.append(timed("probe", probe.kind, probe.model_dump(mode="json"), one))
    return acts


def _verdict(journal: Journal) -> str:
    if journal.expect == "pass":
        return "passed" if journal.passed else "FAILED"
    return f"failed as expected ({journal.expect})" if not journal.passed else (
        "PASSED unexpectedly")


class Session:
    """The stack a group of runbooks shares, with what every run of it saw."""

    def __init__(self, runbook: Runbook) -> None:
        self.state_dir = Path(tempfile.mkdtemp(prefix="dmc-", dir="/tmp"))
        self.stack = Stack(runbook.stack_path(), self.state_dir, dict(runbook.vars),
                           dict(runbook.env))
        self.started_by: str | None = None  # the runbook whose `up` started it
        self.pids: set[int] = set()

    def close(self) -> Teardown:
        """`down` (if a daemon runs) and the leftover search over every pid any run saw."""
        self.started_by = None
        return self.stack.teardown(self.pids)

    def discard(self) -> None:
        shutil.rmtree(self.state_dir, ignore_errors=True)


def groups(runbooks: list[Runbook], share: bool = True) -> list[list[Runbook]]:
    """Runbooks in order of first appearance, those on the same stack, vars and env (and
    allowing it) together; the rest alone."""
    out: list[list[Runbook]] = []
    by_key: dict[tuple[str, str, str], list[Runbook]] = {}
    for rb in runbooks:
        if not (share and rb.shared_stack):
            out.append([rb])
            continue
        key = (rb.stack_path(), repr(sorted(rb.vars.items())), repr(sorted(rb.env.items())))
        if key not in by_key:
            by_key[key] = []
            out.append(by_key[key])
        by_key[key].append(rb)
    return out


def run(runbook: Runbook, profile: Profile, report_dir: Path,
        echo: Callable[[str], None] = print) -> Journal:
    """One runbook on a stack of its own."""
    (journal,) = run_group([runbook], profile, report_dir, echo)
    return journal


def run_all(runbooks: list[Runbook], profile: Profile, report_dir: Path,
            echo: Callable[[str], None] = print, share: bool = True) -> list[Journal]:
    journals: list[Journal] = []
    for group in groups(runbooks, share):
        journals += run_group(group, profile, report_dir, echo)
        if _OPERATOR_STOP in journals[-1].notes:
            break
    return journals


def run_group(runbooks: list[Runbook], profile: Profile, report_dir: Path,
              echo: Callable[[str], None] = print) -> list[Journal]:
    """The runbooks one after the other on one shared stack (fresh again after a run that
    left it broken); the stack is always down at the end."""
    session: Session | None = None
    journals = []
    try:
        for i, runbook in enumerate(runbooks):
            if session is None:
                session = Session(runbook)
            last = i == len(runbooks) - 1
            journal, kept = _run_one(runbook, profile, report_dir, session, last, echo)
            journals.append(journal)
            if not kept:  # down already (the last run, or a broken steady state)
                session = None
            if _OPERATOR_STOP in journal.notes:
                break
    finally:
        if session is not None:  # only after an exception: a run closes it otherwise
            session.close()
            session.discard()
    return journals


def _run_one(runbook: Runbook, profile: Profile, report_dir: Path, session: Session,
             last: bool, echo: Callable[[str], None]) -> tuple[Journal, bool]:
    """One runbook on the session's stack (started here if it is not up): its journal,
    and whether the stack is left in its steady state for the next runbook."""
    spec = runbook.profile(profile)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    run_dir = report_dir / f"{stamp}-{runbook.name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    stack, state_dir = session.stack, session.state_dir
    journal = Journal(runbook.model_dump(mode="json", exclude={"source"}), str(profile),
                      expect=runbook.expect)
    if runbook.expect_note:
        journal.notes.append(runbook.expect_note)
    origin = time.monotonic()
    deadline = origin + spec.timeout
    observer = Observer(state_dir, origin)
    ctx = faults.RunContext(stack, observer, origin, run_dir)
    load: LoadGenerator | None = None
    stack_up = session.started_by is not None
    echo(f"chaos: {runbook.name} ({profile} profile) in {run_dir}"
         + (f" on the stack {session.started_by} started" if stack_up else ""))

    def check_abort() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {profile} profile's bound of {spec.timeout:.0f}s ran out")
        if runbook.abort.daemon_gone and "daemon" not in ctx.healers and not stack.running():
            raise Aborted("the dynamod daemon is gone and no step asked for that")
        if load and load.recent_error_rate(5) > runbook.abort.max_error_rate:
            raise Aborted(f"error rate over the last 5 s above {runbook.abort.max_error_rate:.0%}")

    up_seen: dict[str, object] = {}
    up_must_fail = any(i.check == "up_fails_naming" for i in runbook.invariants)
    try:
        if stack_up:
            journal.notes.append(f"shared stack: started by {session.started_by}; this run "
                                 "began once its steady state held again")
        else:
            act = timed("action", "dynamod up", {"stack": runbook.stack, "vars": runbook.vars},
                        lambda: _up(stack, min(runbook.up_timeout, spec.timeout), up_seen))
            journal.run.append(act)
            code = up_seen.get("returncode")
            ctx.up_returncode = code if isinstance(code, int) else None
            ctx.up_output = str(up_seen.get("output", ""))
            if act.status != "succeeded":
                if up_must_fail:  # the experiment is the refusal itself; the checker judges it
                    act.status = "succeeded"
                    raise _Done()
                raise RuntimeError("the stack did not come up")
            stack_up = True
            session.started_by = runbook.name
        observer.start()
        journal.before = _probe_activities(stack, runbook, deadline)
        if not all(a.status == "succeeded" for a in journal.before):
            raise RuntimeError("the steady state did not hold before the method")
        if runbook.load:
            first_url = stack.frontend_url()
            load = LoadGenerator(runbook.load, lambda: observer.frontend_url(first_url),
                                 _model_name(stack), origin, observer.current_version)
            load.start()
        load_started = time.monotonic()
        for repeat in range(spec.repeat):
            for i, step in enumerate(runbook.method):
                check_abort()
                name = f"{repeat + 1}.{i + 1} {step.action}"
                echo(f"  {name} {_describe(step.model_dump(exclude_defaults=True))}")
                act = timed("action", name, step.model_dump(mode="json"),
                            _performer(ctx, step))
                journal.run.append(act)
                journal.during.append({"after": name, "at": round(ctx.now(), 3), "units": {
                    u["name"]: u["state"] for u in (observer.last or {}).get("units", [])}})
                if act.status != "succeeded":
                    raise RuntimeError(f"step {name} failed: {act.exception}")
        if load and runbook.load:  # the load runs at least load_seconds, then settles
            until = max(load_started + spec.load_seconds, time.monotonic()) + runbook.load.settle
            while time.monotonic() < until:
                check_abort()
                time.sleep(0.2)
    except _Done:
        pass
    except Aborted as exc:
        journal.status = RunStatus.ABORTED
        journal.notes.append(f"aborted: {exc}")
    except TimeoutError as exc:
        journal.status = RunStatus.INTERRUPTED
        journal.notes.append(str(exc))
    except KeyboardInterrupt:
        journal.status = RunStatus.INTERRUPTED
        journal.notes.append(_OPERATOR_STOP)
    except RuntimeError as exc:
        journal.status = RunStatus.FAILED
        journal.notes.append(str(exc))
    finally:
        healthy = _finish(runbook, journal, ctx, session, observer, load, stack_up, last,
                          run_dir, deadline, echo)
    return journal, healthy


def _finish(runbook: Runbook, journal: Journal, ctx: faults.RunContext, session: Session,
            observer: Observer, load: LoadGenerator | None, stack_up: bool, last: bool,
            run_dir: Path, deadline: float, echo: Callable[[str], None]) -> bool:
    """Everything that always runs: rollbacks, heal, steady state after, the leftover search
    (the `down` if this run is the stack's last), judge. True: the stack is left up in its
    steady state for the next runbook."""
    stack, state_dir = session.stack, session.state_dir
    for i, step in enumerate(runbook.rollbacks):
        journal.rollbacks.append(timed("action", f"rollback {i + 1} {step.action}",
                                       step.model_dump(mode="json"), _performer(ctx, step)))
    journal.rollbacks.append(timed("action", "heal every fault", {},
                                   lambda: faults.heal_all(ctx)))
    steady = False
    if stack_up and journal.before and all(a.status == "succeeded" for a in journal.before):
        # the steady state gets what is left of the profile's bound, at least 15 s
        journal.after = _probe_activities(stack, runbook, max(deadline, time.monotonic() + 15))
        journal.deviated = not all(a.status == "succeeded" for a in journal.after)
        steady = not journal.deviated
    if load:
        load.stop()
    observer.sample()
    observer.stop()
    if observer.last is not None:
        for name, answer in stack.ask_shards(observer.last).items():
            for unit in observer.last["units"]:
                if unit["name"] == name:
                    unit["engine"] = answer
    wall_origin = time.time() - ctx.now()
    logged = [s for s in states_from_log(state_dir / "daemon.log", wall_origin) if s.at >= 0]
    history = History(requests=list(load.requests) if load else [],
                      states=logged or observer.states, versions=observer.versions,
                      faults=ctx.faults, cache=observer.cache, final_status=observer.last,
                      port_takes=ctx.port_takes)
    history.start_version = next((v.current for v in observer.versions
                                  if v.current is not None), None)
    history.end = ctx.now()
    history.up_returncode, history.up_output = ctx.up_returncode, ctx.up_output
    session.pids |= observer.pids
    keep = steady and not last and session.started_by is not None and stack.running()
    if keep:
        history.teardown = stack.live_leftovers(observer.pids)
        journal.notes.append("shared stack left up for the next runbook: no_leftovers judged "
                             "on the live stack (processes of units that are gone, "
                             "registrations of dead instances); the group's last run "
                             "judges the `down`")
    else:
        history.teardown = session.close()
    verdicts = checkers.judge(history, runbook.invariants)
    journal.checks = [v.as_dict() for v in verdicts]
    journal.measurements = {
        "requests": len(history.requests), "faults": [f.__dict__ for f in ctx.faults],
        "state_changes": len(history.states), "ledger": history.ledger_changes(),
        **{v.check: v.measured for v in verdicts}}
    journal.end = time.time()
    journal.verdict = _verdict(journal)
    history.write(run_dir / "history.jsonl")
    journal.write(run_dir / "journal.json")
    try:
        draw(history, f"{runbook.name}: {journal.verdict}", run_dir / "timeline.png")
    except ImportError as exc:
        journal.notes.append(f"no timeline picture: {exc} (pip install matplotlib)")
        journal.write(run_dir / "journal.json")
    logs = state_dir / "logs"
    if logs.is_dir():
        shutil.copytree(logs, run_dir / "logs", dirs_exist_ok=True)
    if (state_dir / "daemon.log").exists():
        shutil.copy(state_dir / "daemon.log", run_dir / "daemon.log")
    if not keep:
        session.discard()
    echo(f"  {runbook.name}: {journal.verdict} ({journal.status}, "
         f"{journal.end - journal.start:.0f}s)")
    return keep


def _performer(ctx: faults.RunContext, step: Step) -> Callable[[], object]:
    return lambda: faults.perform(ctx, step)


def _model_name(stack: Stack) -> str:
    worker = next(u for u in stack.status()["units"] if u["name"].startswith("worker@"))
    command: list[str] = worker["command"]
    return command[command.index("--model-name") + 1] if "--model-name" in command else "tiny-cpu"


def _describe(values: dict[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items() if k != "action")
