"""The supervisor's own robustness on real processes (issue 16): probes that hang keep
their deadline and timeout, racing commands report their own outcome, huge output costs
bounded memory, a detached daemon holds none of its caller's pipes, and a stack that
includes one file twice is accepted."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dynamod.client import Client
from dynamod.core.proctable import marked_pids
from tests.conftest import Dynamod, pid_alive, unit_by_name, wait_dead

pytestmark = pytest.mark.slow

PROC = '"{python}", "@PROC@"'


def _up(dm: Dynamod, stack: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return dm.run("up", str(stack), "--detach", timeout=timeout)


def _nothing_left(dm: Dynamod) -> None:
    run_id = dm.run_id()
    assert run_id
    assert wait_dead(marked_pids(run_id), timeout=5) == []


# ------------------------------------------------------------------ 4. probes keep their word


def test_a_hung_exec_probe_is_cut_at_the_deadline(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{PROC}, "sleep"]
        restart = {{ policy = "never" }}
        ready = {{ kind = "exec", command = ["sleep", "100000"], timeout = 1000, deadline = 3 }}
    """)
    result = _up(dm, stack, timeout=300)  # returns at the deadline, not after 1000 s
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not ready within 3s" in result.stderr
    assert "(exec sleep 100000, timeout 1000s) was cut at the deadline" in result.stderr
    _nothing_left(dm)  # the probe's own `sleep 100000` went too


def test_an_exec_probe_that_answers_within_its_timeout_passes(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{PROC}, "sleep"]
        ready = {{ kind = "exec", command = ["sleep", "1.5"], timeout = 5, deadline = 10 }}
    """)
    result = _up(dm, stack)
    assert result.returncode == 0, result.stderr
    assert unit_by_name(dm.status(), "svc")["detail"] == "exec sleep 1.5: exited with status 0"


def test_a_tcp_probe_fails_when_the_handshake_never_completes(
    dm: Dynamod, stack_file: Any
) -> None:
    """A TCP probe passes when the handshake completes, whether or not the server ever
    calls accept(); a listener whose accept queue is full drops the SYN, so no
    handshake completes and each attempt ends at its timeout. The probe waits 1 s between
    attempts: one that lands while the fixture is still filling its queue completes (seen
    at a 0.1 s interval under load), and the fill takes milliseconds."""
    stack = stack_file(f"""
        [units.full]
        command = [{PROC}, "tcp-full", "{{ports.tcp}}"]
        ports = {{ tcp = 0 }}
        restart = {{ policy = "never" }}
        [units.full.ready]
        kind = "tcp"
        port = "{{ports.tcp}}"
        timeout = 1
        interval = 1
        deadline = 5
    """)
    result = _up(dm, stack)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not ready within 5s" in result.stderr
    assert "last probe: no answer within 1s" in result.stderr, result.stderr


def test_a_tcp_probe_passes_on_a_listener_that_never_accepts(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(f"""
        [units.quiet]
        command = [{PROC}, "tcp-quiet", "{{ports.tcp}}"]
        ports = {{ tcp = 0 }}
        [units.quiet.ready]
        kind = "tcp"
        port = "{{ports.tcp}}"
        timeout = 1
        interval = 0.1
        deadline = 10
    """)
    result = _up(dm, stack)
    assert result.returncode == 0, result.stderr
    assert unit_by_name(dm.status(), "quiet")["detail"].endswith("accepts connections")


def _slow_http(timeout: float, deadline: float) -> str:
    return f"""
        [units.slow]
        command = [{PROC}, "slow-http", "{{ports.http}}", "--answer-after", "12"]
        ports = {{ http = 0 }}
        restart = {{ policy = "never" }}
        [units.slow.ready]
        kind = "http"
        url = "http://127.0.0.1:{{ports.http}}/health"
        timeout = {timeout}
        deadline = {deadline}
    """


def test_an_http_answer_after_12s_passes_a_30s_timeout(dm: Dynamod, stack_file: Any) -> None:
    """The daemon's shared HTTP session has total=10 s; the probe's own 30 s must hold.
    While the answer is awaited, the progress line says how long it has waited."""
    result = _up(dm, stack_file(_slow_http(timeout=30, deadline=40)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ready in" in result.stdout
    waits = [float(w) for w in re.findall(r"waiting (\d+\.\d) s for an answer", result.stdout)]
    assert waits and max(waits) > 5, result.stdout  # the current attempt, not a stale result
    detail = unit_by_name(dm.status(), "slow")["detail"]
    assert re.fullmatch(r"GET http://127.0.0.1:\d+/health: 200", detail), detail


def test_an_http_answer_after_12s_fails_a_5s_timeout_saying_5s(
    dm: Dynamod, stack_file: Any
) -> None:
    result = _up(dm, stack_file(_slow_http(timeout=5, deadline=8)))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not ready within 8s" in result.stderr
    assert "no answer within 5s" in result.stderr or "timeout 5s) was cut" in result.stderr


# ------------------------------------------------------------------ 3. racing commands


def _quick_stack(stack_file: Any, name: str = "race") -> Path:
    path: Path = stack_file(f"""
        [stack]
        name = "{name}"
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
    """)
    return path


def _cli(dm: Dynamod, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_ups_at_once_each_report_their_own_daemon(dm: Dynamod, stack_file: Any) -> None:
    stack = _quick_stack(stack_file)
    for trial in range(10):
        clis = [_cli(dm, "up", str(stack), "--detach") for _ in range(2)]
        outcomes = [(c.wait(timeout=60), *c.communicate()) for c in clis]
        winners = [o for o in outcomes if o[0] == 0]
        losers = [o for o in outcomes if o[0] != 0]
        assert len(winners) == 1 and len(losers) == 1, f"trial {trial}: {outcomes}"
        status = dm.status()
        pid = status["daemon_pid"]
        _, out, _ = winners[0]
        assert f"dynamod daemon pid {pid}," in out and "stack race ready in" in out
        _, out, err = losers[0]
        assert "ready" not in out, f"trial {trial}: the loser reported ready:\n{out}"
        if "already runs" not in err:  # it forked a daemon, which lost the lock
            assert f"(pid {pid}, stack race, run {status['run_id']}) holds state dir" in err, err
        else:  # it saw the winner's socket before forking
            assert f"(pid {pid}, stack race, run {status['run_id']}) already runs" in err, err
        dm.run("down", check=True)
        assert wait_dead([pid]) == []


def test_down_racing_up_is_reported_by_both(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file(f"""
        [stack]
        name = "slowup"
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}", "--delay", "30"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", deadline = 60 }}
    """)
    up = _cli(dm, "up", str(stack), "--detach")
    dm.wait_for(lambda s: s["phase"] == "starting", what="a daemon that is starting")
    down = dm.run("down")
    code = up.wait(timeout=60)
    out, err = up.communicate()
    assert down.returncode == 0 and "nothing left running" in down.stdout, down.stderr
    assert code == 1 and "ready in" not in out
    assert "did not come up: shutdown requested before the stack was ready" in err, err
    _nothing_left(dm)


def test_restart_racing_down_is_refused_not_started_again(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(f"""
        [units.svc]
        command = [{PROC}, "serve", "{{ports.http}}", "--stop-delay", "8"]
        ports = {{ http = 0 }}
        ready = {{ kind = "http", url = "http://127.0.0.1:{{ports.http}}/health", interval = 0.05 }}
        stop = {{ timeout = 30 }}
    """)
    assert _up(dm, stack).returncode == 0
    restart = _cli(dm, "restart", "svc")  # svc takes 8 s to stop: `down` comes meanwhile
    client = Client(dm.state_dir)
    deadline = time.monotonic() + 60
    while unit_by_name(client.status(), "svc")["state"] != "stopping":
        assert time.monotonic() < deadline, "svc never began stopping for the restart"
        time.sleep(0.02)
    down = dm.run("down")
    code = restart.wait(timeout=60)
    _, err = restart.communicate()
    assert down.returncode == 0 and "nothing left running" in down.stdout
    assert code == 1 and "svc was stopped, not started again: the stack is stopping" in err
    _nothing_left(dm)


# ------------------------------------------------------------------ 5. huge output


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_one_huge_line_costs_bounded_memory_and_shows_in_logs(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = stack_file(f"""
        [units.quiet]
        command = [{PROC}, "sleep"]
        [units.spew]
        command = [{PROC}, "spew", "60"]
        depends_on = {{ quiet = "started" }}
        ready = {{ kind = "log", pattern = "^done$", deadline = 60 }}
    """)
    result = _up(dm, stack)
    assert result.returncode == 0, result.stderr
    status = dm.status()
    rss = _rss_kb(status["daemon_pid"])
    assert rss < 150_000, f"daemon RSS {rss} kB after a 60 MB line"
    logs = dm.state_dir / "logs"
    sizes = {p.name: p.stat().st_size for p in logs.glob("spew.log*")}
    assert sum(sizes.values()) > 60 << 20 and len(sizes) > 1  # rotated, nothing lost
    shown = dm.run("logs", "spew", "-n", "3", check=True).stdout.splitlines()
    assert shown[0].startswith("--- dynamod: start #1 pid ")  # from an older file
    assert shown[-1] == "done"
    assert set(shown[1]) == {"x"} and len(shown) == 4


# ------------------------------------------------------------------ 6. smaller ones


def test_up_detach_returns_under_a_wrapper_holding_a_pipe(
    dm: Dynamod, stack_file: Any
) -> None:
    stack = _quick_stack(stack_file)
    extra_read, extra_write = os.pipe()
    cmd = [sys.executable, "-m", "dynamod", "--state-dir", str(dm.state_dir),
           "up", str(stack), "--detach"]
    cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           pass_fds=(extra_write,))
    os.close(extra_write)
    try:
        out, err = cli.communicate(timeout=60)  # EOF on both pipes: the daemon holds neither
        assert cli.returncode == 0, err
        assert "ready in" in out
        readable, _, _ = select.select([extra_read], [], [], 10)
        assert readable and os.read(extra_read, 1) == b"", "the daemon holds the extra pipe"
    finally:
        os.close(extra_read)
    assert pid_alive(dm.status()["daemon_pid"])


def test_a_file_included_through_two_includes_is_accepted_once(
    dm: Dynamod, tmp_path: Path
) -> None:
    (tmp_path / "c.toml").write_text('[units.c]\ncommand = ["true"]\n')
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(
            f'[stack]\ninclude = ["c.toml"]\n[units.{name}]\ncommand = ["true"]\n')
    stack = tmp_path / "stack.toml"
    stack.write_text('[stack]\ninclude = ["a.toml", "b.toml"]\n')
    result = dm.run("check", str(stack))
    assert result.returncode == 0, result.stderr
    assert "is valid, 3 units" in result.stdout


