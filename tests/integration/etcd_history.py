"""etcd's kept history, read through its JSON gateway: write one key again and again, and
ask for an old revision of it (etcd refuses one that a compaction removed)."""

from __future__ import annotations

import base64
import time

from tests.integration.rawstack import http_json

KEY = base64.b64encode(b"dynamod-test/history").decode()


def etcd_call(port: int, path: str, body: dict[str, object]) -> dict[str, object]:
    """etcd's JSON answer (an error's too: the gateway answers those with JSON)."""
    _, answer = http_json("POST", f"http://127.0.0.1:{port}/v3/{path}", body, timeout=2)
    assert isinstance(answer, dict), answer
    return answer


def rewrite(port: int, times: int) -> list[int]:
    """Put the test key `times` times; the revisions they made."""
    revisions = []
    for i in range(times):
        value = base64.b64encode(b"%d" % i).decode()
        put = etcd_call(port, "kv/put", {"key": KEY, "value": value})
        revisions.append(int(put["header"]["revision"]))  # type: ignore[index]
    return revisions


def kept(port: int, revision: int, wait_s: float) -> bool:
    """Whether the test key at `revision` stays readable for `wait_s`: False as soon as
    etcd says that revision was compacted."""
    deadline = time.monotonic() + wait_s
    while True:
        answer = etcd_call(port, "kv/range", {"key": KEY, "revision": revision})
        if "compacted" in str(answer.get("error", "")):
            return False
        assert answer.get("kvs"), answer  # readable: the value written then is still there
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.25)
