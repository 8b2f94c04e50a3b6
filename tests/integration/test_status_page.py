"""The status page (`up --web`) in a real headless Chromium: it shows the units of a real
daemon, a kill -9 within 2 s without a reload, and the next daemon after the first was
killed; a token, once asked for, is needed on every request. The refusals of bad
addresses, and the pure parts, are in tests/unit/test_statuspage.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import cli_inprocess
from tests.conftest import Dynamod
from tests.integration.chromium import Browser, Page, find_binary
from tests.integration.test_events import STACK  # a db and a worker that restarts at once

pytestmark = pytest.mark.slow


TOKEN = "s3cret-page-token-0123456789"

# Each unit's row as the page shows it: name -> {state, pid, restarts}.
ROWS = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('#units tr[data-unit]')]
  .map(r => [r.dataset.unit, {state: r.querySelector('.state').textContent,
    pid: r.querySelector('.pid').textContent,
    restarts: r.querySelector('.restarts').textContent}])))"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_binary()
    if binary is None:
        pytest.skip("no chromium-headless-shell or chromium (scripts/install.sh installs it)")
    chromium = Browser(binary)
    yield chromium
    chromium.close()


def rows(page: Page) -> dict[str, dict[str, str]]:
    value: dict[str, dict[str, str]] = json.loads(page.evaluate(ROWS))
    return value


def shows(page: Page, condition: str, timeout: float, what: str) -> Any:
    """Wait until the page's rows (`rows` in the expression) make `condition` true."""
    return page.wait_for(f"(() => {{ const rows = {ROWS.replace(chr(10), ' ')}; "
                         f"const r = JSON.parse(rows); return {condition}; }})()",
                         timeout, what)  # fmt: skip


def get(url: str, **headers: str) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def _chaos_run(state_dir: Path) -> None:
    """One kept chaos run, as `dynamod chaos run --report STATE_DIR/chaos-runs` leaves it."""
    run = state_dir / "chaos-runs" / "20261203-020000-kill-worker"
    run.mkdir(parents=True)
    (run / "journal.json").write_text(json.dumps({
        "experiment": {"name": "kill-worker"}, "start": "2026-12-03T02:00:00",
        "verdict": "passed", "passed": True}))  # fmt: skip
    (run / "timeline.png").write_bytes(b"\x89PNG\r\n\x1a\n-not-a-real-picture")


def test_the_page_follows_a_kill_and_a_new_daemon(
    dm: Dynamod, stack_file: Any, browser: Browser, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}/"
    stack = str(stack_file(STACK))
    _chaos_run(dm.state_dir)
    up = dm.run("up", stack, "--detach", "--web", f"127.0.0.1:{port}", check=True)
    assert f"status page: {base}" in up.stdout
    shown = cli_inprocess.run(["--state-dir", str(dm.state_dir), "status"])  # asks the daemon
    assert shown.code == 0 and f"status page: {base}" in shown.stdout, shown
    first = dm.status()
    worker = dm.unit("worker")

    page = browser.open(f"{base}?token={TOKEN}")  # the token serves the second daemon
    shows(page, f"r.worker && r.worker.pid === '{worker['pid']}' && r.db.state === 'ready'",
          10, "the units")  # fmt: skip
    assert page.evaluate("document.body.dataset.runId") == first["run_id"]
    assert "kill-worker" in page.evaluate("document.getElementById('chaos').textContent")
    code, _, kind = get(page.evaluate("document.querySelector('#chaos a').href"))
    assert (code, kind) == (200, "image/png")
    assert get(f"{base}chaos/..%2F..%2Fdynamod.pid/timeline.png")[0] == 404
    assert get(f"{base}api/status", Host=f"rebound.example:{port}")[0] == 403

    os.kill(worker["pid"], signal.SIGKILL)
    shows(page, f"r.worker.pid !== '{worker['pid']}' && r.worker.restarts === '1'", 2.0,
          "the kill (a new pid, one restart) within 2 s")  # fmt: skip
    page.wait_for("document.getElementById('events').textContent.includes('killed by SIGKILL')",
                  2.0, "the kill in the last events")  # fmt: skip

    os.kill(first["daemon_pid"], signal.SIGKILL)
    page.wait_for("document.body.dataset.conn === 'lost'", 5, "that the daemon is gone")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    dm.run("up", stack, "--detach", "--web", f"127.0.0.1:{port}", "--web-token",
           str(token_file), check=True)  # fmt: skip
    second = dm.status()
    assert second["run_id"] != first["run_id"]
    page.wait_for(f"document.body.dataset.runId === '{second['run_id']}' && "
                  "document.body.dataset.conn === 'live'", 5, "the new daemon")  # fmt: skip
    shows(page, f"r.worker.pid === '{dm.unit('worker')['pid']}' && r.worker.restarts === '0'",
          5, "the new daemon's units")  # fmt: skip
    assert get(f"{base}api/status")[0] == 403
    assert get(f"{base}api/status?token=not-{TOKEN}")[0] == 403
    code, body, _ = get(f"{base}api/status", Authorization=f"Bearer {TOKEN}")
    assert code == 200 and json.loads(body)["status"]["run_id"] == second["run_id"]


def test_the_stack_file_names_the_page(dm: Dynamod, stack_file: Any, tmp_path: Path) -> None:
    """`[web]` in the stack file serves the page without `--web`; its token file unreadable:
    one line naming the file and field, exit 2, nothing started."""
    port = free_port()
    missing = stack_file(STACK + f'\n[web]\naddress = "127.0.0.1:{port}"\n'
                         'token_file = "no-such-token"\n', name="missing.toml")  # fmt: skip
    refused = dm.run("up", str(missing), "--detach")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "missing.toml, field 'web.token_file'" in lines[0], lines
    assert not (dm.state_dir / "dynamod.sock").exists()
    stack = stack_file(STACK + f'\n[web]\naddress = "127.0.0.1:{port}"\n')
    up = dm.run("up", str(stack), "--detach", check=True)
    assert f"status page: http://127.0.0.1:{port}/" in up.stdout
    code, body, _ = get(f"http://127.0.0.1:{port}/api/status")
    assert code == 200 and json.loads(body)["status"]["run_id"] == dm.status()["run_id"]
