"""`dynamod export supervisord`: the exported infra stack runs under the real supervisord,
and supervisord's own parser reads what the exporter wrote."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamod.core.ports import listening
from dynamod.ops.supervisord import supervisorctl_name
from tests.conftest import PROC, Dynamod, pid_alive, wait_dead

pytestmark = pytest.mark.slow

Result = subprocess.CompletedProcess[str]
SUPERVISORD = Path(sys.executable).parent / "supervisord"
SUPERVISORCTL = Path(sys.executable).parent / "supervisorctl"


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


def wait_json(url: str, expected: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = get_json(url)
        except OSError as exc:
            last = exc
        if last == expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url}: expected {expected}, last answer {last!r}")


@pytest.fixture
def exported(dm: Dynamod, tmp_path: Path) -> Iterator[tuple[Path, Result]]:
    conf = tmp_path / "infra.conf"
    result = dm.run("export", "supervisord", "infra", "--out", str(conf), check=True)
    logs = dm.state_dir / "logs"
    assert not logs.exists()  # an export writes nothing but --out; it says what to create
    assert f"before starting supervisord: mkdir -p {logs}" in result.stderr
    logs.mkdir()
    yield conf, result


def test_export_reports_what_supervisord_cannot_do(
    exported: tuple[Path, Result],
) -> None:
    conf, result = exported
    for gap in ("readiness gating", "dependency conditions", "liveness probes",
                "rejoin / lease revocation", "process tree sweep"):
        assert gap in result.stderr
    text = conf.read_text()
    assert "[program:etcd]" in text and "[program:nats]" in text
    assert "stopasgroup=true" in text and "killasgroup=true" in text


def test_supervisord_parses_the_export(dm: Dynamod, stack_file: object, tmp_path: Path) -> None:
    """Replicas, odd environment values and odd arguments survive supervisord's parser."""
    from supervisor.datatypes import RestartUnconditionally
    from supervisor.options import ServerOptions

    path = stack_file(  # type: ignore[operator]
        """
        [units.db]
        command = ["{python}", "@PROC@", "serve", "{ports.http}", "--name", "a b;c #d 100%"]
        ports = { http = 0 }
        env = { QUOTED = '["generate"]', PCT = "50%", SPACES = "a, b = c", EMPTY = "" }
        restart = { policy = "always", limit_burst = 7 }
        stop = { signal = "SIGINT", timeout = 4.5 }
        ready = { kind = "tcp", port = "{ports.http}" }

        [units.worker]
        replicas = 2
        command = ["{python}", "@PROC@", "sleep"]
        depends_on = ["db"]
        restart = { policy = "never" }
        """
    )
    conf = tmp_path / "odd.conf"
    dm.run("export", "supervisord", str(path), "--out", str(conf), check=True)
    (dm.state_dir / "logs").mkdir()  # as the export says: supervisord does not make it
    options = ServerOptions()
    options.realize(args=["-c", str(conf)])
    groups = {g.name: g for g in options.process_group_configs}
    programs = {p.name: p for g in groups.values() for p in g.process_configs}
    # a unit's replicas are one group (stopped together), `worker:worker-0` to supervisorctl
    assert set(groups) == {"db", "worker"}
    assert set(programs) == {"db", "worker-0", "worker-1"}
    assert {p.name for p in groups["worker"].process_configs} == {"worker-0", "worker-1"}
    assert supervisorctl_name("worker@1") == "worker:worker-1" and supervisorctl_name("db") == "db"
    db, worker = programs["db"], programs["worker-0"]
    argv = shlex.split(db.command)
    assert argv[:3] == [sys.executable, str(PROC), "serve"]
    assert argv[-2:] == ["--name", "a b;c #d 100%"]
    assert db.environment["QUOTED"] == '["generate"]'
    assert db.environment["PCT"] == "50%"
    assert db.environment["SPACES"] == "a, b = c"
    assert db.environment["EMPTY"] == ""
    assert db.environment["PATH"].startswith(f"{Path(sys.executable).parent}:")
    assert db.environment["PATH"].endswith(os.environ["PATH"])
    assert db.stopsignal == signal.SIGINT and db.stopwaitsecs == 5
    assert db.startretries == 7 and db.autorestart is RestartUnconditionally
    assert worker.autorestart is False
    assert db.priority < worker.priority == programs["worker-1"].priority
    assert groups["db"].priority < groups["worker"].priority == worker.priority
    assert db.stopasgroup and db.killasgroup


def test_exported_infra_runs_under_supervisord_and_stops_clean(
    dm: Dynamod, exported: tuple[Path, Result]
) -> None:
    conf, _ = exported
    text = conf.read_text()
    etcd_url = re.search(r"--listen-client-urls (http://127\.0\.0\.1:\d+)", text)
    nats_monitor = re.search(r"nats-server .* -m (\d+)", text)
    assert etcd_url and nats_monitor
    ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)]
    ports += [int(p) for p in re.findall(r" -[pm] (\d+)", text)]

    supervisord = subprocess.Popen(
        [str(SUPERVISORD), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        wait_json(f"{etcd_url.group(1)}/health", {"health": "true", "reason": ""})
        wait_json(f"http://127.0.0.1:{nats_monitor.group(1)}/healthz", {"status": "ok"})
        for program in ("etcd", "nats"):
            out = subprocess.run(
                [str(SUPERVISORCTL), "-c", str(conf), "pid", program],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            pids.append(int(out))
        assert all(pid_alive(p) for p in pids)
        # unit logs land where `dynamod logs` reads them
        logs = dm.run("logs", "nats", check=True).stdout
        assert "Server is ready" in logs

        supervisord.send_signal(signal.SIGTERM)
        assert supervisord.wait(timeout=30) == 0
    finally:
        if supervisord.poll() is None:
            os.killpg(supervisord.pid, signal.SIGKILL)
            supervisord.wait(timeout=10)
        for pid in wait_dead(pids, timeout=15):  # only if the assertion below fails
            os.kill(pid, signal.SIGKILL)
    assert wait_dead(pids, timeout=0) == []
    assert [p for p in ports if listening(p)] == []
    assert not (dm.state_dir / "supervisord.pid").exists()
