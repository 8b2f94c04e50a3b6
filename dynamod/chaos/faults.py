"""The method's actions, one function each: signals to a unit's process, pause and
resume, a pause claimed outside dynamod whose pauser is killed, policy pushes (good,
corrupt, or with a shard killed mid-push), fault-proxy settings, the daemon killed and
restarted, a unit's port taken before it binds again, and the waits and assertions
between them.
Every fault is marked in the history and registers its healer, which the rollbacks run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dynamod.chaos import pauser
from dynamod.chaos.history import Fault, PortTake, UnitSeen
from dynamod.chaos.model import (
    DaemonKillStep,
    DiskFullStep,
    KillStep,
    OrphanPauseStep,
    PauseStep,
    ProxyStep,
    PushStep,
    ResumeStep,
    Step,
    TakePortStep,
    TrainerProgressStep,
    WaitStateStep,
    WaitStep,
)
from dynamod.chaos.observer import Observer
from dynamod.chaos.stack import Stack, StackError, pid_alive
from dynamod.core.errors import DaemonError, DynamodError


class StepFailed(DynamodError):
    """A step could not do what it says, or its assertion did not hold."""


@dataclass
class RunContext:
    stack: Stack
    observer: Observer
    origin: float
    work_dir: Path
    faults: list[Fault] = field(default_factory=list)
    healers: dict[str, Callable[[], str]] = field(default_factory=dict)
    hit_pids: dict[str, int] = field(default_factory=dict)  # unit -> pid its last fault hit
    port_takes: list[PortTake] = field(default_factory=list)
    up_returncode: int | None = None
    up_output: str = ""

    def now(self) -> float:
        return time.monotonic() - self.origin

    def mark(self, name: str, target: str | None, at: float | None = None) -> int:
        """Record a fault at `at` (default now). A signal's fault is dated just before the
        signal: the daemon may record the unit's exit before this thread gets back here
        (seen under load: ready -> backoff 34 ms before the mark, and recovery_time then
        found no exit after the fault)."""
        self.faults.append(Fault(self.now() if at is None else at, name, target))
        return len(self.faults) - 1

    def healed(self, index: int) -> None:
        self.faults[index] = replace(self.faults[index], healed_at=self.now())


def _poll(until: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = until()
        if value:
            return value
        time.sleep(every)
    raise StepFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _signal_same(pid: int, started: str | None, sig: signal.Signals) -> bool:
    """Signal `pid` only if it is still the process we meant (not a reused pid)."""
    if started is None or _start_time(pid) != started or not pid_alive(pid):
        return False
    os.kill(pid, sig)
    return True


def kill(ctx: RunContext, step: KillStep) -> dict[str, Any]:
    pid = ctx.stack.pid_of(step.unit)
    at = ctx.now()
    os.kill(pid, signal.Signals[step.signal])
    ctx.hit_pids[step.unit] = pid
    ctx.mark(f"{step.signal} {step.unit}", step.unit, at)
    return {"unit": step.unit, "pid": pid, "signal": step.signal}


def _pause(ctx: RunContext, unit: str) -> tuple[int, str | None, int]:
    pid = ctx.stack.pid_of(unit)
    started = _start_time(pid)
    at = ctx.now()
    os.kill(pid, signal.SIGSTOP)
    ctx.hit_pids[unit] = pid
    index = ctx.mark(f"SIGSTOP {unit}", unit, at)

    def heal() -> str:
        ctx.healed(index)
        return f"SIGCONT {unit} pid {pid}: " + (
            "sent" if _signal_same(pid, started, signal.SIGCONT) else "already gone")

    ctx.healers[f"pause:{unit}"] = heal
    return pid, started, index


def pause(ctx: RunContext, step: PauseStep) -> dict[str, Any]:
    pid, _, _ = _pause(ctx, step.unit)
    out: dict[str, Any] = {"unit": step.unit, "pid": pid}
    if step.seconds:
        time.sleep(step.seconds)
        out["resume"] = ctx.healers.pop(f"pause:{step.unit}")()
    return out


def resume(ctx: RunContext, step: ResumeStep) -> dict[str, Any]:
    heal = ctx.healers.pop(f"pause:{step.unit}", None)
    if heal is None:
        raise StepFailed(f"{step.unit} was not paused by this run")
    return {"unit": step.unit, "resume": heal()}


def orphan_pause(ctx: RunContext, step: OrphanPauseStep) -> dict[str, Any]:
    """The fault is the pauser's death (marked then): from there nobody but dynamod will
    resume the shard, which must leave ready (held), take the ledger's version and serve."""
    url = (ctx.stack.unit(step.unit).get("dynamo") or {}).get("system_url")
    if not url:
        raise StepFailed(f"{step.unit} has no system URL in dynamod's status: not a shard")
    try:
        proc, _ = pauser.start(ctx.stack.state_dir, step.unit, url)
    except RuntimeError as exc:
        raise StepFailed(str(exc)) from None

    def end() -> str:
        proc.kill()
        proc.wait(timeout=10)
        return f"pauser pid {proc.pid} of {step.unit} killed"

    ctx.healers[f"orphan_pause:{step.unit}"] = end
    time.sleep(step.seconds)
    at = ctx.now()
    ctx.healers.pop(f"orphan_pause:{step.unit}")()
    ctx.mark(f"the pauser of {step.unit} killed -9, its claim open", step.unit, at)
    return {"unit": step.unit, "pauser": proc.pid, "held_s": step.seconds}


def wait(ctx: RunContext, step: WaitStep) -> dict[str, Any]:
    time.sleep(step.seconds)
    return {"seconds": step.seconds}


def wait_state(ctx: RunContext, step: WaitStateStep) -> dict[str, Any]:
    # "new pid": not the process the last fault on this unit hit (it may already have
    # been replaced before this step began), else not the one running now.
    before = ctx.hit_pids.get(step.unit) or ctx.stack.unit(step.unit).get("pid")
    started = time.monotonic()

    def reached() -> dict[str, Any] | None:
        try:
            unit = ctx.stack.unit(step.unit)
        except DaemonError:
            return None
        if unit["state"] != step.state or (step.new_pid and unit.get("pid") == before):
            return None
        return unit

    unit = _poll(reached, step.timeout, f"{step.unit} to be {step.state}"
                 + (" under a new pid" if step.new_pid else ""))
    return {"unit": step.unit, "state": unit["state"], "pid": unit.get("pid"),
            "waited_s": round(time.monotonic() - started, 3)}


def _checkpoint(ctx: RunContext, version: int, corrupt: str, pad_mb: int = 0) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    base = ctx.stack.model_dir()
    out = ctx.work_dir / "checkpoints" / f"step-{version}-{corrupt}"
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    scale = 1.0 + 0.01 * version
    tensors = {k: (v.float() * scale).to(v.dtype) for k, v in tensors.items()}
    if pad_mb:
        tensors["padding"] = torch.ones(pad_mb * 256 * 1024, dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    target = out / "model.safetensors"
    if corrupt == "truncated":  # header intact, data cut short
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif corrupt == "garbage":
        target.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return out


def push(ctx: RunContext, step: PushStep) -> dict[str, Any]:
    before = ctx.stack.client.policy_status()["current"] or 0
    version = int(before) + 1
    path = _checkpoint(ctx, version, step.corrupt, step.pad_mb)
    if step.corrupt != "none":
        ctx.mark(f"corrupt checkpoint ({step.corrupt})", None)
    answer: dict[str, Any] = {}
    error: list[str] = []

    def send() -> None:
        try:
            answer.update(ctx.stack.client.policy_push(version, path, timeout=step.timeout))
        except DaemonError as exc:
            error.append(str(exc))

    victim: dict[str, Any] = {}
    if step.kill_unit:  # stopped first, so the push surely reaches it and waits on it
        victim["pid"] = ctx.stack.pid_of(step.kill_unit)
        os.kill(victim["pid"], signal.SIGSTOP)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    if step.kill_unit:
        time.sleep(step.kill_after)
        at = ctx.now()
        os.kill(victim["pid"], signal.SIGKILL)
        ctx.hit_pids[step.kill_unit] = victim["pid"]
        ctx.mark(f"SIGKILL {step.kill_unit} mid-push", step.kill_unit, at)
    if step.kill_daemon_after is not None:
        time.sleep(step.kill_daemon_after)
        index = ctx.mark("SIGKILL dynamod daemon mid-push", None)
        victim["daemon_pid"] = ctx.stack.kill_daemon()
        sender.join(step.timeout + 5)
        result = ctx.stack.up(timeout=step.timeout)
        ctx.healed(index)
        if result.returncode != 0:
            raise StepFailed(f"dynamod up after the daemon was killed mid-push exited "
                             f"{result.returncode}: {result.stderr.strip()[-400:]}")
    sender.join(step.timeout + 5)
    after = ctx.stack.client.policy_status()["current"]
    out = {"version": version, "path": str(path), "ledger_before": before, "ledger_after": after,
           "answer": {k: answer[k] for k in ("ok", "stale", "seconds") if k in answer},
           "error": error[0] if error else None, **victim}
    if step.expect == "ok" and (error or not answer.get("ok")):
        raise StepFailed(f"push of version {version} failed: {error[0] if error else answer}")
    if step.expect == "refused":
        if not error:
            raise StepFailed(f"push of a {step.corrupt} checkpoint was accepted: {answer}")
        if after != before:
            raise StepFailed(f"refused push moved the ledger {before} -> {after}")
    return out


def _proxy_control(ctx: RunContext, unit: str, faults: dict[str, Any]) -> dict[str, Any]:
    port = ctx.stack.unit(unit)["ports"]["control"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/faults", data=json.dumps(faults).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


_HEALTHY = {"latency_ms": 0, "jitter_ms": 0, "reset_rate": 0, "bandwidth_kbps": 0,
            "down": False}


def proxy(ctx: RunContext, step: ProxyStep) -> dict[str, Any]:
    faults = {k: getattr(step, k) for k in _HEALTHY}
    answer = _proxy_control(ctx, step.unit, faults)
    if faults == _HEALTHY:
        healer = ctx.healers.pop(f"proxy:{step.unit}", None)
        return {"unit": step.unit, "healed": healer() if healer else "nothing set",
                "proxy": answer}
    desc = ", ".join(f"{k}={v}" for k, v in faults.items() if v)
    index = ctx.mark(f"proxy {step.unit}: {desc}", None)

    def heal() -> str:
        ctx.healed(index)
        return json.dumps(_proxy_control(ctx, step.unit, _HEALTHY))

    ctx.healers[f"proxy:{step.unit}"] = heal
    out: dict[str, Any] = {"unit": step.unit, "set": faults, "proxy": answer}
    if step.seconds:
        time.sleep(step.seconds)
        out["healed"] = ctx.healers.pop(f"proxy:{step.unit}")()
    return out


def kill_daemon(ctx: RunContext, step: DaemonKillStep) -> dict[str, Any]:
    pid = ctx.stack.kill_daemon()
    index = ctx.mark("SIGKILL dynamod daemon", None)
    out: dict[str, Any] = {"daemon_pid": pid}
    if step.restart:
        time.sleep(step.down_for)
        result = ctx.stack.up(timeout=step.timeout)
        ctx.healed(index)
        out.update(up_status=result.returncode, up_output=result.stdout[-400:])
        if result.returncode != 0:
            raise StepFailed(f"dynamod up after the daemon was killed exited "
                             f"{result.returncode}: {result.stderr.strip()[-400:]}")
    else:
        def heal() -> str:
            ctx.healed(index)
            return f"up exited {ctx.stack.up().returncode}"

        ctx.healers["daemon"] = heal
    return out


def disk_full(ctx: RunContext, step: DiskFullStep) -> dict[str, Any]:
    import subprocess

    target = (ctx.stack.state_dir / step.path).resolve()
    if ctx.stack.state_dir.resolve() not in target.parents:
        raise StepFailed(f"{step.path!r} is not inside the state dir")
    target.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step.size_kb}k", "tmpfs",
                            str(target)], capture_output=True, text=True)
    if mount.returncode != 0:
        reason = f"skipped: cannot mount a tmpfs here ({mount.stderr.strip() or 'not root?'})"
        print(f"  disk_full {reason}", flush=True)
        return {"path": str(target), "skipped": reason}
    index = ctx.mark(f"{'read-only' if step.readonly else 'full'} {step.path}", None)
    filler = target / ".chaos-fill"
    if step.readonly:
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=False)
    else:
        with filler.open("wb") as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 65536)

    def heal() -> str:
        ctx.healed(index)
        done = subprocess.run(["umount", "-l", str(target)], capture_output=True, text=True)
        return f"umount {target}: " + ("ok" if done.returncode == 0 else done.stderr.strip())

    ctx.healers[f"disk:{step.path}"] = heal
    out: dict[str, Any] = {"path": str(target), "size_kb": step.size_kb,
                           "readonly": step.readonly}
    if step.seconds:
        time.sleep(step.seconds)
        out["healed"] = ctx.healers.pop(f"disk:{step.path}")()
    return out


def listen_when_free(
    port: int, timeout: float, address: str = "127.0.0.1", backlog: int = 16
) -> socket.socket:
    """A listener on `address:port` (never accepting: a client connects and hears nothing)
    as soon as the socket of the process that held it is gone; OSError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            sock.listen(backlog)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)


def take_port(ctx: RunContext, step: TakePortStep) -> dict[str, Any]:
    unit = ctx.stack.unit(step.unit)
    port = (unit.get("ports") or {}).get(step.port)
    if not port:
        raise StepFailed(f"unit {step.unit!r} has no port {step.port!r} "
                         f"(ports: {unit.get('ports') or {}})")
    victim = ctx.stack.pid_of(step.unit) if step.restart else None
    at = ctx.now()
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
        ctx.hit_pids[step.unit] = victim
    try:
        sock = listen_when_free(int(port), timeout=5)
    except OSError as exc:
        raise StepFailed(f"could not take port {port}: {exc}") from None
    owner = Path("/proc/self/comm").read_text().strip()
    index = ctx.mark(f"port {step.port}={port} of {step.unit} taken", step.unit, at)
    take = PortTake(ctx.now(), step.unit, step.port, int(port), os.getpid(), owner)
    ctx.port_takes.append(take)

    def heal() -> str:
        sock.close()
        if take.released_at is None:
            take.released_at = ctx.now()
            ctx.healed(index)
        return f"port {port} released"

    ctx.healers[f"port:{step.unit}:{step.port}"] = heal
    deadline = time.monotonic() + step.seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(DaemonError, StackError):
            seen = ctx.stack.unit(step.unit)
            take.seen.append(UnitSeen(ctx.now(), seen["state"], str(seen.get("detail") or ""),
                                      dict(seen.get("ports") or {})))
        time.sleep(0.25)
    released = ctx.healers.pop(f"port:{step.unit}:{step.port}")()
    last = take.seen[-1] if take.seen else None
    return {"unit": step.unit, "port": port, "owner_pid": take.owner_pid, "killed_pid": victim,
            "last_state": last.state if last else None,
            "last_detail": last.detail[-300:] if last else None, "released": released}


def wait_version(ctx: RunContext, step: TrainerProgressStep) -> dict[str, Any]:
    def reached() -> int | None:
        current = ctx.observer.current_version()
        return current if current is not None and current >= step.version else None

    return {"version": _poll(reached, step.timeout, f"the ledger to reach {step.version}")}


ACTIONS: dict[str, Callable[[RunContext, Any], dict[str, Any]]] = {
    "kill": kill,
    "pause": pause,
    "resume": resume,
    "orphan_pause": orphan_pause,
    "wait": wait,
    "wait_state": wait_state,
    "push": push,
    "proxy": proxy,
    "kill_daemon": kill_daemon,
    "wait_version": wait_version,
    "disk_full": disk_full,
    "take_port": take_port,
}


def perform(ctx: RunContext, step: Step) -> dict[str, Any]:
    if step.after:
        time.sleep(step.after)
    try:
        return ACTIONS[step.action](ctx, step)
    except StackError as exc:
        raise StepFailed(str(exc)) from None


def heal_all(ctx: RunContext) -> list[str]:
    """Jepsen's final heal: every fault still in force is undone, newest first."""
    out = []
    for key in reversed(list(ctx.healers)):
        try:
            out.append(f"{key}: {ctx.healers.pop(key)()}")
        except (OSError, DynamodError) as exc:
            out.append(f"{key}: heal failed: {exc}")
    return out
