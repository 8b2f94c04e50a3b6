"""The stack a chaos run drives: brought up and down with the real `dynamod` CLI on its
own state dir, asked through the control client, and its daemon killed and restarted.
Every pid it hands out comes from the daemon's status, so faults only reach processes
dynamod started."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dynamod.chaos.history import Teardown
from dynamod.client import Client
from dynamod.core import runrecord
from dynamod.core.argv import flag_value
from dynamod.core.errors import DaemonError, DynamodError
from dynamod.core.proctable import marked_pids


class StackError(DynamodError):
    """A unit the runbook names is not in the stack, or the stack would not come up."""


# The flag that names the served model: our CPU worker's, then dynamo.vllm's.
_MODEL_NAME_FLAGS = ("--model-name", "--served-model-name")

# How long a shard whose liveness answer does not say whether it is paused has to answer a
# pinned 1-token completion before it counts as paused: a warm real shard on this CPU
# answers one in under a second; its first generation after a start can take tens.
PAUSE_ANSWER_S = 30.0


def served_model_name(command: list[str], default: str = "tiny-cpu") -> str:
    """The model a shard serves, from its command line (`default` if it names none)."""
    for flag in _MODEL_NAME_FLAGS:
        value = flag_value(command, flag)
        if value is not None:
            return value
    return default


def served_model(status: dict[str, Any]) -> str:
    """The model the stack's shards serve, from its first worker's command line."""
    worker = next((u for u in status["units"] if u["name"].startswith("worker@")), None)
    return served_model_name(worker["command"]) if worker else "tiny-cpu"


def dead_registrations(keys: list[str], status: dict[str, Any]) -> list[str]:
    """The worker instance keys (`v1/instances/NS/.../generate/ID`) in the stack's own
    Dynamo namespaces that no running unit owns. Another namespace on the same etcd is
    someone else's (a second stack, a test's own worker), not this stack's leftover; with
    no namespace known, every key is judged."""
    units = status["units"]
    owned = {str(i) for u in units if u.get("pid")
             for i in (u.get("dynamo") or {}).get("instance_ids", [])}
    owned |= {format(int(i), "x") for i in owned if i.isdigit()}
    spaces = {ns for u in units if (ns := (u.get("dynamo") or {}).get("namespace"))}
    workers = [k for k in keys if "/generate/" in k
               and (not spaces or bool(spaces.intersection(k.split("/")[2:3])))]
    return [k for k in workers if k.rsplit("/", 1)[-1] not in owned]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Stack:
    def __init__(self, stack: str, state_dir: Path, variables: dict[str, Any],
                 env: dict[str, str] | None = None) -> None:
        self.stack = stack
        self.env = env or {}
        self.state_dir = state_dir
        self.variables = variables
        self.client = Client(state_dir, timeout=30)
        self.run_ids: set[str] = set()

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(self.state_dir), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})

    def up(self, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`up --detach --timeout`: ready within `timeout`, or torn down with the reason."""
        var_args = [a for k, v in self.variables.items() for a in ("--var", f"{k}={v}")]
        result = self.cli("up", self.stack, "--detach", "--timeout", str(timeout), *var_args,
                          timeout=timeout + 120)
        self.note_run_id()
        return result

    def note_run_id(self) -> None:
        """Remember the run id of the daemon on the state dir (its processes' marker)."""
        run = runrecord.read(self.state_dir)
        if run is not None:
            self.run_ids.add(run.run_id)

    def status(self) -> dict[str, Any]:
        return self.client.status()

    def unit(self, name: str) -> dict[str, Any]:
        status = self.status()
        for unit in status["units"]:
            if unit["name"] == name:
                return dict(unit)
        names = ", ".join(u["name"] for u in status["units"])
        raise StackError(f"unit {name!r} is not in stack {status.get('stack')!r} ({names})")

    def pid_of(self, name: str) -> int:
        unit = self.unit(name)
        if not unit.get("pid"):
            raise StackError(f"unit {name!r} has no running process (state {unit['state']})")
        return int(unit["pid"])

    def frontend_url(self) -> str:
        return _frontend_url(self.unit("frontend"))

    def model_dir(self) -> Path:
        """The served model's directory, from a shard's command line: our CPU worker's
        `--model-path`, dynamo.vllm's `--model`."""
        worker = next(u for u in self.status()["units"] if u["name"].startswith("worker@"))
        command = worker["command"]
        flag = next((f for f in ("--model-path", "--model") if f in command), None)
        if flag is None or command.index(flag) + 1 >= len(command):
            raise StackError(f"{worker['name']}: no --model-path or --model in its command")
        return Path(command[command.index(flag) + 1])

    def kill_daemon(self) -> int:
        pid = int(self.status()["daemon_pid"])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pid

    def running(self) -> bool:
        return self.client.running()

    def stale_registrations(self, status: dict[str, Any]) -> list[str]:
        """Worker instance keys in etcd that no running unit owns."""
        from dynamod.rollout.etcd import EtcdClient

        etcd = next((u for u in status["units"] if u["name"] == "etcd"), None)
        if etcd is None or etcd["state"] != "ready":
            return []

        async def keys() -> list[str]:
            url = f"http://127.0.0.1:{etcd['ports']['client']}"
            async with EtcdClient(url) as client:
                return [kv.key for kv in await client.get_prefix("v1/instances/")]

        try:
            found = asyncio.run(keys())
        except Exception as exc:
            return [f"(could not list etcd registrations: {exc})"]
        return dead_registrations(found, status)

    def ask_shards(self, status: dict[str, Any], answer_within: float = PAUSE_ANSWER_S
                   ) -> dict[str, Any]:  # fmt: skip
        """Each running shard's own answer to `get_weight_version` (not dynamod's claim),
        with `paused`: its liveness answer's where that says (the CPU worker's does);
        otherwise (dynamo.vllm's does not) whether it answered a 1-token completion pinned
        to it through the frontend within `answer_within` s (a paused engine holds it), and
        `paused_seen` saying which."""
        answers: dict[str, Any] = {}
        frontend = _frontend(status)
        for unit in status.get("units", []):
            url = (unit.get("dynamo") or {}).get("system_url")
            if "policy_version" not in unit or not url or not unit.get("pid"):
                continue
            try:
                answer = engine_call(url, "get_weight_version")
            except (OSError, ValueError) as exc:
                answers[unit["name"]] = {"error": str(exc)}
                continue
            try:  # apart: a liveness answer that fails leaves the version's as it was
                live = engine_call(url, "liveness_probe")
            except (OSError, ValueError):
                live = None
            if isinstance(answer, dict) and isinstance(live, dict) and "paused" in live:
                answer["paused"], answer["paused_seen"] = live["paused"], "liveness"
            elif isinstance(answer, dict) and isinstance(live, dict) and frontend:
                answer.update(_answers_pinned(frontend, unit, answer_within))
            answers[unit["name"]] = answer
        return answers

    def live_leftovers(self, pids: set[int]) -> Teardown:
        """What a run left on a stack that stays up for the next runbook: processes it saw
        that no unit (nor the daemon) owns any more yet still live with the stack's marker,
        and registrations of dead instances. Each leftover is recorded, then ended."""
        td = Teardown(down_output="(shared stack left up; `down` is judged by its last run)")
        try:
            status = self.status()
        except DaemonError as exc:
            td.down_ok, td.down_output = False, f"the shared stack's daemon is gone: {exc}"
            return td
        owned = {int(u["pid"]) for u in status["units"] if u.get("pid")}
        owned.add(int(status.get("daemon_pid") or 0))
        td.stale_registrations = self.stale_registrations(status)
        gone = {p for p in pids if p not in owned and pid_alive(p)}
        # only processes that still carry this stack's run marker: a pid seen once and
        # reused since by someone else's process is not ours to judge or end
        td.alive_pids = sorted({p for run_id in self.run_ids
                                for p in marked_pids(run_id, among=gone)})
        for pid in td.alive_pids:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return td

    def teardown(self, pids: set[int]) -> Teardown:
        """`down`, then look for anything left: pids seen, the run's marker, ports."""
        td = Teardown()
        ports: set[int] = set()
        try:
            status = self.status()
            td.stale_registrations = self.stale_registrations(status)
            ports = {int(p) for u in status["units"] for p in (u.get("ports") or {}).values()}
        except DaemonError:
            pass
        if self.running():
            result = self.cli("down", timeout=180)
            td.down_ok = result.returncode == 0
            td.down_output = result.stdout + result.stderr
        left = {p for p in pids if pid_alive(p)}
        for run_id in self.run_ids:
            left |= set(marked_pids(run_id))
        td.alive_pids = sorted(left)
        td.bound_ports = sorted(p for p in ports if _listening(p))
        for pid in td.alive_pids:  # leave nothing running, after recording it
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return td


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _frontend(status: dict[str, Any]) -> tuple[str, str] | None:
    """The frontend's URL and the model the shards serve, from the stack's status."""
    units = status.get("units", [])
    front = next((u for u in units if u["name"] == "frontend" and u.get("pid")), None)
    if front is None or "http" not in (front.get("ports") or {}):
        return None
    return _frontend_url(front), served_model(status)


def _frontend_url(frontend: dict[str, Any]) -> str:
    """The frontend's HTTP URL on loopback, from its status row."""
    return f"http://127.0.0.1:{frontend['ports']['http']}"


def _answers_pinned(frontend: tuple[str, str], unit: dict[str, Any], within: float
                    ) -> dict[str, Any]:  # fmt: skip
    """`paused` by the shard's answer to a 1-token completion pinned to its instance: a
    paused engine (pause_generation, mode keep) holds it unanswered; nothing is said of a
    shard with no instance or whose answer is an error."""
    import json
    import urllib.request

    instances = (unit.get("dynamo") or {}).get("instance_ids") or []
    if not instances:
        return {}
    url, model = frontend
    body = {"model": model, "prompt": "dynamod: are you paused?", "max_tokens": 1,
            "nvext": {"backend_instance_id": instances[0]}}  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    silent = {"paused": True,
              "paused_seen": f"no answer to a pinned 1-token completion within {within:g}s"}
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=within) as resp:
            resp.read()
    except TimeoutError:
        return silent
    except OSError as exc:  # URLError wraps a timeout while connecting; others: no word
        return silent if isinstance(getattr(exc, "reason", None), TimeoutError) else {}
    took = time.monotonic() - started
    return {"paused": False, "paused_seen": f"answered a pinned 1-token completion in {took:.2f}s"}


def engine_call(url: str, route: str, body: dict[str, Any] | None = None) -> Any:
    """A shard's own answer to `route` at its system URL (`/engine/<route>`), blocking."""
    import json
    import urllib.request

    request = urllib.request.Request(f"{url}/engine/{route}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())
