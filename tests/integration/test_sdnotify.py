"""sd_notify against a real NOTIFY_SOCKET: `dynamod up infra` in the foreground, as
systemd would run it (Type=notify, WatchdogSec)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Dynamod, wait_dead

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 1_000_000  # dynamod pets every 0.5 s


class NotifySocket:
    """The receiving end systemd would hold: one datagram per sd_notify call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append((time.monotonic(), fields))
        return fields

    def wait_for(self, key: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            fields = self.receive(left)
            if fields is not None and key in fields:
                return fields
        raise AssertionError(f"no {key}= within {timeout}s; got {self.keys()}")

    def collect(
        self, seconds: float, key: str | None = None, count: int | None = None
    ) -> list[dict[str, str]]:
        """Everything that arrives within the next `seconds` (only messages carrying
        `key`, when given; at most `count`, returning as soon as that many arrived)."""
        got: list[dict[str, str]] = []
        deadline = time.monotonic() + seconds
        while (count is None or len(got) < count) and (
            left := deadline - time.monotonic()
        ) > 0:
            if (fields := self.receive(left)) is not None and (key is None or key in fields):
                got.append(fields)
        return got

    def drain(self, quiet: float) -> list[dict[str, str]]:
        """Everything that arrives until nothing has for `quiet` seconds."""
        got = []
        while (fields := self.receive(quiet)) is not None:
            got.append(fields)
        return got

    def keys(self) -> list[str]:
        return [k for _, fields in self.messages for k in fields]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    path = Path(f"/tmp/dm-notify-{os.getpid()}.sock")
    path.unlink(missing_ok=True)
    sock = NotifySocket(path)
    yield sock
    sock.close()
    path.unlink(missing_ok=True)


def test_ready_status_watchdog_stopping_and_stalled_loop(
    dm: Dynamod, notify_socket: NotifySocket
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WATCHDOG_PID"}
    env |= {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir), "up", "infra"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    unit_pids: list[int] = []
    try:
        ready = notify_socket.wait_for("READY", timeout=30)
        assert ready["READY"] == "1"
        assert ready["STATUS"] == "2/2 units ready"
        before_ready = [f for _, f in notify_socket.messages[:-1]]
        assert "READY" not in {k for f in before_ready for k in f}
        assert any(f.get("STATUS", "").startswith("stack infra starting: ") for f in before_ready)

        status = dm.status()
        assert status["daemon_pid"] == daemon.pid
        unit_pids = [u["pid"] for u in status["units"]]

        # pets keep coming, about every WATCHDOG_USEC / 2 (the first 4, or 10 s at most)
        pets = notify_socket.collect(10, key="WATCHDOG", count=4)
        assert len(pets) >= 4 and all(p["WATCHDOG"] == "1" for p in pets)
        times = [t for t, f in notify_socket.messages if "WATCHDOG" in f][-len(pets) :]
        # Receive times jitter when the test itself is descheduled (two queued datagrams
        # read back to back), so judge the mean period, not each gap: about half the
        # watchdog's interval, and below it (systemd would not fire).
        period = (times[-1] - times[0]) / (len(times) - 1)
        assert 0.25 < period < 0.9, times

        # a stalled daemon stops petting, and pets again once it runs
        os.kill(daemon.pid, signal.SIGSTOP)
        notify_socket.drain(quiet=0.05)  # what was in flight before the stop
        assert notify_socket.collect(1.5) == []
        os.kill(daemon.pid, signal.SIGCONT)
        assert notify_socket.wait_for("WATCHDOG", timeout=10)["WATCHDOG"] == "1"

        # SIGTERM: STOPPING=1, then a clean exit
        daemon.send_signal(signal.SIGTERM)
        assert notify_socket.wait_for("STOPPING", timeout=10)["STOPPING"] == "1"
        assert daemon.wait(timeout=30) == 0
        notify_socket.drain(quiet=0.3)
    finally:
        if daemon.poll() is None:  # the test failed midway: end the daemon (and its units)
            os.kill(daemon.pid, signal.SIGCONT)
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=10)
    assert wait_dead(unit_pids, timeout=5) == []
    assert not (dm.state_dir / "dynamod.sock").exists()

    keys = notify_socket.keys()
    first = {key: keys.index(key) for key in ("READY", "WATCHDOG", "STOPPING")}
    assert keys.index("STATUS") < first["READY"] < first["STOPPING"]
    watchdog_between = [
        i for i, k in enumerate(keys) if k == "WATCHDOG" and first["READY"] < i < first["STOPPING"]
    ]
    assert len(watchdog_between) >= 3
    # STATUS updates after READY say what changed (here: the stack going down)
    assert any(
        f.get("STATUS", "").startswith("stack infra stopping") for _, f in notify_socket.messages
    )
    assert notify_socket.messages[-1][1] == {"STATUS": "stopped"}
