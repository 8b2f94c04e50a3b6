"""A small synchronous client for the control socket (used by the CLI, chaos runs, the verl
backend, tests and trainers). Standard library only, so `dynamod status` starts fast."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from dynamod.core.errors import DaemonError
from dynamod.core.paths import socket_path


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.unix_path))
        self.sock = sock


class NoDaemonError(DaemonError):
    """Nothing listens on the state dir's socket: no daemon runs there (or not yet)."""


class UnknownUnitError(DaemonError):
    """The daemon has no unit by the name a command gave (bad input)."""


class BadInputError(DaemonError):
    """The daemon refused what a command sent as invalid (a stack file that does not
    validate): bad input, exit 2, nothing changed."""


class Client:
    def __init__(self, state_dir: Path, timeout: float = 30.0) -> None:
        self.state_dir = state_dir
        self.path = socket_path(state_dir)
        self.timeout = timeout

    def request(
        self, method: str, route: str, body: Any = None, timeout: float | None = None
    ) -> Any:
        conn = _UnixConnection(self.path, timeout or self.timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload else {}
            conn.request(method, route, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except FileNotFoundError:
            raise NoDaemonError(
                f"no dynamod daemon is running for state dir {self.state_dir} "
                f"(no socket at {self.path}); start one with `dynamod up`"
            ) from None
        except ConnectionRefusedError:
            raise NoDaemonError(
                f"no dynamod daemon is running for state dir {self.state_dir} "
                f"({self.path} is a stale socket: nothing listens on it); "
                "start one with `dynamod up`"
            ) from None
        except OSError as exc:
            raise DaemonError(f"talking to dynamod at {self.path} failed: {exc}") from None
        finally:
            conn.close()
        if resp.status == 404 and not data.startswith(b"{"):
            raise DaemonError(_no_route(route))
        try:
            answer = json.loads(data) if data else {}
        except ValueError:
            raise DaemonError(f"dynamod answered {route} with non-JSON: {data[:200]!r}") from None
        if resp.status == 404 and "error" in answer:
            raise UnknownUnitError(answer["error"])
        if resp.status == 422 and "error" in answer:
            raise BadInputError(answer["error"])
        if resp.status >= 400:
            raise DaemonError(answer.get("error", f"{route}: HTTP {resp.status}"))
        return answer

    def running(self) -> bool:
        try:
            self.status()
        except DaemonError:
            return False
        return True

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/status", timeout=10)
        return result

    def down(self, timeout: float = 600) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", "/down", timeout=timeout)
        return result

    def down_cluster(self, wait_s: float = 30, timeout: float = 900) -> dict[str, Any]:
        """Stop every node of a cluster stack; node -> what it stopped or why not."""
        result: dict[str, Any] = self.request(
            "POST", "/cluster/down", {"wait_s": wait_s}, timeout=timeout
        )
        return result

    def forget_node(self, node: str) -> dict[str, Any]:
        """A cluster node gone for good (`dynamod cluster forget`): what went with it."""
        result: dict[str, Any] = self.request("POST", "/cluster/forget", {"node": node}, timeout=60)
        return result

    def restart(self, unit: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", f"/restart/{unit}", timeout=120)
        return result

    def stop(self, unit: str, timeout: float = 600) -> dict[str, Any]:
        """Hold UNIT (a replica, or all replicas by base name) stopped until `start`."""
        result: dict[str, Any] = self.request("POST", f"/stop/{unit}", timeout=timeout)
        return result

    def start(self, unit: str) -> dict[str, Any]:
        """Start units held stopped by `stop` again."""
        result: dict[str, Any] = self.request("POST", f"/start/{unit}", timeout=60)
        return result

    def apply(
        self,
        path: str | Path | None = None,
        variables: dict[str, Any] | None = None,
        *,
        scale: tuple[str, int] | None = None,
        dry_run: bool = False,
        timeout: float = 300,
    ) -> dict[str, Any]:
        """The diff from the running stack to the file at `path` (with `variables` on top of
        the ones it was started with), or to it with `scale` = (unit, replicas); applied
        unless `dry_run`. BadInputError if the file does not validate."""
        body: dict[str, Any] = {"vars": variables or {}, "dry_run": dry_run, "timeout": timeout}
        if path is not None:
            body["path"] = str(Path(path).absolute())
        if scale is not None:
            body["scale"] = list(scale)
        result: dict[str, Any] = self.request("POST", "/apply", body, timeout=timeout + 60)
        return result

    def policy_push(
        self, step: int, path: str | Path, timeout: float = 900, serving: int | None = None
    ) -> dict[str, Any]:
        """Load checkpoint `path` as policy version `step` into every admitted shard.
        `serving`: answer once that many of the node's shards serve it (the rest after)."""
        body: dict[str, Any] = {"step": step, "path": str(path)}
        if serving is not None:
            body["serving"] = serving
        result: dict[str, Any] = self.request("POST", "/policy/push", body, timeout=timeout)
        return result

    def policy_publish(
        self, step: int, path: str | Path, timeout: float = 300,
        acks: dict[str, str | None] | None = None,
    ) -> dict[str, Any]:
        """Record that the trainer loaded `step` into the shards itself; dynamod verifies.
        `acks`: shard -> the digest it acknowledged; an admitted shard missing is stale."""
        body: dict[str, Any] = {"step": step, "path": str(path)}
        if acks is not None:
            body["acks"] = acks
        result: dict[str, Any] = self.request("POST", "/policy/publish", body, timeout=timeout)
        return result

    def policy_status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/policy", timeout=30)
        return result

    def policy_pause(self, shards: list[str], why: str) -> dict[str, Any]:
        """Claim, as this process, the pause of `shards` (this node's unit names) it is about
        to make: dynamod shows it and rejoins them if this process exits before they are
        resumed (rollout/pause_claims.py)."""
        body = {"shards": shards, "why": why}
        result: dict[str, Any] = self.request("POST", "/policy/pause", body, timeout=30)
        return result

    def policy_release(self, shards: list[str] | None = None) -> dict[str, Any]:
        """This process's pause claims on `shards` (None: all of them) end."""
        body = {} if shards is None else {"shards": shards}
        result: dict[str, Any] = self.request("POST", "/policy/release", body, timeout=30)
        return result

    def policy_spares(self, sleep: bool) -> dict[str, Any]:
        """Put the spare shards to sleep (control/sleep level 1) or wake them."""
        result: dict[str, Any] = self.request(
            "POST", "/policy/spares", {"sleep": sleep}, timeout=60
        )
        return result


def _no_route(route: str) -> str:
    """The daemon answers a route only where its stack enables the part behind it."""
    why = {
        "/policy": "its stack has no [policy] table, so there is no policy ledger or spares",
    }
    for prefix, reason in why.items():
        if route.startswith(prefix):
            return f"the running daemon does not serve {route}: {reason}"
    return f"the running daemon does not serve {route} (an older dynamod, or a feature off)"
