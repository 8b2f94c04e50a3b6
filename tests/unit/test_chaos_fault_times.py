"""A signal's fault is dated before the signal (pure: the kill is intercepted): the daemon
may record the unit's exit before the runbook's thread gets back to mark the fault, and
`recovery_time` looks for the unit leaving ready at or after the fault. Seen under load:
ready -> backoff 34 ms before the mark, and the verdict said the trainer was never ready
again."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.chaos import faults
from dynamod.chaos.model import KillStep


def test_a_kill_is_dated_before_its_signal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ctx = faults.RunContext(
        stack=SimpleNamespace(pid_of=lambda unit: 4242),  # type: ignore[arg-type]
        observer=None,  # type: ignore[arg-type]
        origin=time.monotonic(),
        work_dir=tmp_path,
    )
    sent: list[float] = []

    def kill(pid: int, sig: Any) -> None:
        sent.append(ctx.now())
        time.sleep(0.05)  # the daemon notices and records meanwhile; this thread is late

    monkeypatch.setattr(faults.os, "kill", kill)
    faults.kill(ctx, KillStep(action="kill", unit="trainer"))
    (fault,) = ctx.faults
    assert fault.target == "trainer" and fault.at <= sent[0], (fault.at, sent)


def test_mark_keeps_now_as_its_default(tmp_path: Path) -> None:
    ctx = faults.RunContext(stack=None, observer=None, origin=time.monotonic(),  # type: ignore[arg-type]
                            work_dir=tmp_path)  # fmt: skip
    before = ctx.now()
    ctx.mark("x", None)
    ctx.mark("y", None, at=0.5)
    assert ctx.faults[0].at >= before and ctx.faults[1].at == 0.5
