"""Runs runbooks end to end: up the stack on a fresh state dir, check the steady state,
start the load and the observer, perform the method (abort conditions checked between
steps, within the profile's time bound), then always: rollbacks and the final heal, the
steady state again, the leftover search, the checkers over the whole recorded history, and
the journal, the history and the timeline written to the run's folder. Runbooks of one
group (`groups`: the same stack, vars and env, each allowing it) share one started stack:
the next one starts once its steady state holds again, the leftover search between them
looks at the live stack (dead units' processes, registrations of dead instances), and the
group's last runbook judges the `down`. A runbook that leaves the steady state broken
hands the next one a fresh stack. A stack someone else started (a test module's) can be
adopted: the runbooks run on it, and it is left up for its owner to take down."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dynamod.chaos import checkers, faults, steady
from dynamod.chaos.history import History, Teardown
from dynamod.chaos.journal import Activity, Journal, RunStatus, timed
from dynamod.chaos.load import LoadGenerator
from dynamod.chaos.model import Probe, Profile, Runbook, Step
from dynamod.chaos.observer import Observer, states_from_log
from dynamod.chaos.stack import Stack, served_model
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
    """The stack a group of runbooks shares, with what every run of it saw. `owned`: the
    runner started it on a state dir of its own, takes it down and removes that dir; an
    adopted one (`adopt`) belongs to its caller, who took it up and takes it down."""

    def __init__(self, stack: Stack, started_by: str | None = None, owned: bool = True) -> None:
        self.stack = stack
        self.state_dir = stack.state_dir
        self.started_by = started_by  # the runbook whose `up` started it (or the owner)
        self.owned = owned
        self.pids: set[int] = set()

    @classmethod
    def fresh(cls, runbook: Runbook) -> Session:
        state_dir = Path(tempfile.mkdtemp(prefix="dmc-", dir="/tmp"))
        return cls(Stack(runbook.stack_path(), state_dir, dict(runbook.vars),
                         dict(runbook.env)))

    @classmethod
    def adopt(cls, stack: str, state_dir: Path, started_by: str,
              variables: dict[str, Any] | None = None) -> Session:
        """A stack `started_by` took up on `state_dir` (`stack` and `variables`: as it was
        started, should a step have to `up` it again): runbooks run on it once their
        steady state holds, each judging no_leftovers on the live stack; it is never taken
        down here."""
        adopted = Stack(stack, state_dir, dict(variables or {}))
        adopted.note_run_id()
        return cls(adopted, started_by=started_by, owned=False)

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
              echo: Callable[[str], None] = print,
              session: Session | None = None) -> list[Journal]:
    """The runbooks one after the other on one shared stack (fresh again after a run that
    left it broken); the stack is always down at the end. With an adopted `session`
    (Session.adopt) every runbook runs on that stack and it stays up: its owner downs it."""
    journals = []
    try:
        for i, runbook in enumerate(runbooks):
            if session is None:
                session = Session.fresh(runbook)
            last = i == len(runbooks) - 1
            journal, kept = _run_one(runbook, profile, report_dir, session, last, echo)
            journals.append(journal)
            if not kept and session.owned:  # down already (the last run, or broken)
                session = None
            if _OPERATOR_STOP in journal.notes:
                break
    finally:
        if session is not None and session.owned:  # only after an exception
            session.close()
            session.discard()
    return journals


def _run_one(runbook: Runbook, profile: Profile, report_dir: Path, session: Session,
             last: bool, echo: Callable[[str], None]) -> tuple[Journal, bool]:
    """One runbook on the session's stack (started here if it is not up): its journal,
    and whether the stack is left in its steady state for the next runbook."""
    run = _RunbookRun(runbook, profile, report_dir, session, echo)
    journal = run.journal
    try:
        run.perform()
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
        healthy = run.finish(last)
    return journal, healthy


class _RunbookRun:
    """One run of one runbook: its folder, journal, fault context, observer and load.
    `perform` is the experiment (up, steady state before, method, load); `finish` is what
    always runs after it, whatever happened."""

    def __init__(self, runbook: Runbook, profile: Profile, report_dir: Path,
                 session: Session, echo: Callable[[str], None]) -> None:
        self.runbook, self.profile, self.session, self.echo = runbook, profile, session, echo
        self.spec = runbook.profile(profile)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.run_dir = report_dir / f"{stamp}-{runbook.name}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stack = session.stack
        self.journal = Journal(runbook.model_dump(mode="json", exclude={"source"}),
                               str(profile), expect=runbook.expect)
        if runbook.expect_note:
            self.journal.notes.append(runbook.expect_note)
        origin = time.monotonic()
        self.deadline = origin + self.spec.timeout
        self.observer = Observer(session.state_dir, origin)
        self.ctx = faults.RunContext(self.stack, self.observer, origin, self.run_dir)
        self.load: LoadGenerator | None = None
        self.stack_up = session.started_by is not None
        echo(f"chaos: {runbook.name} ({profile} profile) in {self.run_dir}"
             + (f" on the stack {session.started_by} started" if self.stack_up else ""))

    def check_abort(self) -> None:
        abort = self.runbook.abort
        if time.monotonic() > self.deadline:
            raise TimeoutError(
                f"the {self.profile} profile's bound of {self.spec.timeout:.0f}s ran out")
        if abort.daemon_gone and "daemon" not in self.ctx.healers and not self.stack.running():
            raise Aborted("the dynamod daemon is gone and no step asked for that")
        if self.load and self.load.recent_error_rate(5) > abort.max_error_rate:
            raise Aborted(f"error rate over the last 5 s above {abort.max_error_rate:.0%}")

    def perform(self) -> None:
        if self.stack_up:
            self.journal.notes.append(f"shared stack: started by {self.session.started_by}; "
                                      "this run began once its steady state held again")
        else:
            self._up()
        self.observer.start()
        self.journal.before = _probe_activities(self.stack, self.runbook, self.deadline)
        if not all(a.status == "succeeded" for a in self.journal.before):
            raise RuntimeError("the steady state did not hold before the method")
        load_started = self._start_load()
        for repeat in range(self.spec.repeat):
            for i, step in enumerate(self.runbook.method):
                self._step(f"{repeat + 1}.{i + 1} {step.action}", step)
        if self.load and self.runbook.load:  # the load runs at least load_seconds, then settles
            until = (max(load_started + self.spec.load_seconds, time.monotonic())
                     + self.runbook.load.settle)
            while time.monotonic() < until:
                self.check_abort()
                time.sleep(0.2)

    def _up(self) -> None:
        runbook, ctx = self.runbook, self.ctx
        seen: dict[str, object] = {}
        act = timed("action", "dynamod up", {"stack": runbook.stack, "vars": runbook.vars},
                    lambda: _up(self.stack, min(runbook.up_timeout, self.spec.timeout), seen))
        self.journal.run.append(act)
        code = seen.get("returncode")
        ctx.up_returncode = code if isinstance(code, int) else None
        ctx.up_output = str(seen.get("output", ""))
        if act.status != "succeeded":
            if any(i.check == "up_fails_naming" for i in runbook.invariants):
                act.status = "succeeded"  # the experiment is the refusal; the checker judges it
                raise _Done()
            raise RuntimeError("the stack did not come up")
        self.stack_up = True
        self.session.started_by = runbook.name

    def _start_load(self) -> float:
        if self.runbook.load:
            first_url = self.stack.frontend_url()
            self.load = LoadGenerator(
                self.runbook.load, lambda: self.observer.frontend_url(first_url),
                served_model(self.stack.status()), self.ctx.origin, self.observer.current_version)
            self.load.start()
        return time.monotonic()

    def _step(self, name: str, step: Step) -> None:
        self.check_abort()
        self.echo(f"  {name} {_describe(step.model_dump(exclude_defaults=True))}")
        act = timed("action", name, step.model_dump(mode="json"), _performer(self.ctx, step))
        self.journal.run.append(act)
        units = (self.observer.last or {}).get("units", [])
        self.journal.during.append({"after": name, "at": round(self.ctx.now(), 3),
                                    "units": {u["name"]: u["state"] for u in units}})
        if act.status != "succeeded":
            raise RuntimeError(f"step {name} failed: {act.exception}")

    def finish(self, last: bool) -> bool:
        """Everything that always runs: rollbacks, heal, steady state after, the leftover
        search (the `down` if this run is the stack's last), judge. True: the stack is left
        up in its steady state for the next runbook."""
        journal, session = self.journal, self.session
        for i, step in enumerate(self.runbook.rollbacks):
            journal.rollbacks.append(timed("action", f"rollback {i + 1} {step.action}",
                                           step.model_dump(mode="json"),
                                           _performer(self.ctx, step)))
        journal.rollbacks.append(timed("action", "heal every fault", {},
                                       lambda: faults.heal_all(self.ctx)))
        steady = self._steady_after()
        if self.load:
            self.load.stop()
        self.observer.sample()
        self.observer.stop()
        history = self._history()
        session.pids |= self.observer.pids
        keep = steady and not last and session.started_by is not None and self.stack.running()
        if keep or not session.owned:
            history.teardown = self.stack.live_leftovers(self.observer.pids)
            journal.notes.append(
                "shared stack left up: no_leftovers judged on the live stack (processes of "
                "units that are gone, registrations of dead instances); "
                + ("the group's last run judges the `down`" if session.owned else
                   f"the stack is {session.started_by}'s, which takes it down"))
        else:
            history.teardown = session.close()
        self._judge_and_save(history)
        if not keep and session.owned:
            session.discard()
        self.echo(f"  {self.runbook.name}: {journal.verdict} ({journal.status}, "
                  f"{journal.end - journal.start:.0f}s)")
        return keep

    def _steady_after(self) -> bool:
        journal = self.journal
        if not (self.stack_up and journal.before
                and all(a.status == "succeeded" for a in journal.before)):
            return False
        # the steady state gets what is left of the profile's bound, at least 15 s
        until = max(self.deadline, time.monotonic() + 15)
        journal.after = _probe_activities(self.stack, self.runbook, until)
        journal.deviated = not all(a.status == "succeeded" for a in journal.after)
        return not journal.deviated

    def _history(self) -> History:
        """What the run recorded: requests, unit states (from the daemon's log where it
        has them), versions, faults, and the shards' own answers at the end."""
        observer, ctx, load = self.observer, self.ctx, self.load
        if observer.last is not None:
            for name, answer in self.stack.ask_shards(observer.last).items():
                for unit in observer.last["units"]:
                    if unit["name"] == name:
                        unit["engine"] = answer
        wall_origin = time.time() - ctx.now()
        daemon_log = self.session.state_dir / "daemon.log"
        logged = [s for s in states_from_log(daemon_log, wall_origin) if s.at >= 0]
        history = History(requests=list(load.requests) if load else [],
                          states=logged or observer.states, versions=observer.versions,
                          faults=ctx.faults, cache=observer.cache, final_status=observer.last,
                          port_takes=ctx.port_takes)
        history.start_version = next((v.current for v in observer.versions
                                      if v.current is not None), None)
        history.end = ctx.now()
        history.up_returncode, history.up_output = ctx.up_returncode, ctx.up_output
        return history

    def _judge_and_save(self, history: History) -> None:
        journal, run_dir, state_dir = self.journal, self.run_dir, self.session.state_dir
        verdicts = checkers.judge(history, self.runbook.invariants)
        journal.checks = [v.as_dict() for v in verdicts]
        journal.measurements = {
            "requests": len(history.requests), "faults": [f.__dict__ for f in self.ctx.faults],
            "state_changes": len(history.states), "ledger": history.ledger_changes(),
            **{v.check: v.measured for v in verdicts}}
        journal.end = time.time()
        journal.verdict = _verdict(journal)
        history.write(run_dir / "history.jsonl")
        journal.write(run_dir / "journal.json")
        try:
            draw(history, f"{self.runbook.name}: {journal.verdict}", run_dir / "timeline.png")
        except ImportError as exc:
            journal.notes.append(f"no timeline picture: {exc} (pip install matplotlib)")
            journal.write(run_dir / "journal.json")
        logs = state_dir / "logs"
        if logs.is_dir():
            shutil.copytree(logs, run_dir / "logs", dirs_exist_ok=True)
        if (state_dir / "daemon.log").exists():
            shutil.copy(state_dir / "daemon.log", run_dir / "daemon.log")


def _performer(ctx: faults.RunContext, step: Step) -> Callable[[], object]:
    return lambda: faults.perform(ctx, step)


def _describe(values: dict[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items() if k != "action")
