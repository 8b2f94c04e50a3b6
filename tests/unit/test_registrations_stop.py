"""A stopping daemon's last try at a pending revocation: where etcd does not answer, its
log line says that no retry comes and what then removes the registration (the previous
wording promised a retry that a stopping daemon never makes)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from structlog.testing import capture_logs

from dynamod.rollout.registrations import DynamoRegistrations


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens there now: each connection is refused


async def test_a_revocation_that_fails_at_stop_says_no_retry_comes() -> None:
    registrations = DynamoRegistrations()
    registrations.host = SimpleNamespace(  # type: ignore[assignment]
        engine=SimpleNamespace(session=None), stack=SimpleNamespace(identity="s", cluster=None)
    )
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    registrations.pending["worker@0"] = ("worker@0", endpoint, [0x1234])
    with capture_logs() as logs:
        await registrations.stop()
    failed = [e for e in logs if e["event"] == "dynamo.revoke_failed"]
    assert len(failed) == 1, logs
    assert failed[0]["consequence"].startswith("this daemon is stopping and tries no more"), failed
    assert "retried" not in failed[0]["consequence"]
    assert registrations.pending, "nothing was revoked: the entry stays"
