"""Bad stacks are refused before anything starts, with file, unit and field named."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Dynamod

pytestmark = pytest.mark.slow


def assert_nothing_started(dm: Dynamod) -> None:
    assert not (dm.state_dir / "dynamod.sock").exists()
    assert not (dm.state_dir / "logs").exists()


def test_unknown_key(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file('[units.a]\ncommand = ["true"]\nrestrat = { policy = "never" }\n')
    result = dm.run("up", str(stack), "--detach")
    assert result.returncode == 2
    assert f"{stack}, unit 'a', field 'restrat': unknown key" in result.stderr
    assert "nothing was started" in result.stderr
    assert_nothing_started(dm)


def test_cycle(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file("""
        [units.a]
        command = ["true"]
        depends_on = ["b"]
        [units.b]
        command = ["true"]
        depends_on = ["a"]
    """)
    result = dm.run("check", str(stack))
    assert result.returncode == 2 and "dependency cycle: a -> b -> a" in result.stderr
    result = dm.run("up", str(stack))
    assert result.returncode == 2
    assert_nothing_started(dm)


def test_missing_executable_names_how_to_install(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file("""
        [units.store]
        command = ["etcd-but-not-installed", "--x"]
        install_hint = "install it with scripts/install.sh"
    """)
    result = dm.run("up", str(stack), "--detach")
    assert result.returncode == 2
    assert "command 'etcd-but-not-installed' is not installed" in result.stderr
    assert "install it with scripts/install.sh" in result.stderr
    assert_nothing_started(dm)


def test_fixed_port_in_use_is_reported_before_spawning(
    dm: Dynamod, stack_file: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "spawned"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        stack = stack_file(f"""
            [units.first]
            command = ["touch", "{marker}"]
            type = "oneshot"
            [units.web]
            command = ["sleep", "60"]
            ports = {{ http = {port} }}
        """)
        result = dm.run("up", str(stack), "--detach")
    assert result.returncode == 2
    assert f"unit 'web': port http={port} is already in use" in result.stderr
    assert not marker.exists()
    assert_nothing_started(dm)


def test_status_without_daemon_says_how_to_start(dm: Dynamod) -> None:
    result = dm.run("status")
    assert result.returncode == 1 and "no dynamod daemon is running" in result.stderr


def test_second_up_on_same_state_dir_is_refused(dm: Dynamod, stack_file: Any) -> None:
    stack = stack_file('[units.s]\ncommand = ["sleep", "60"]\n')
    dm.run("up", str(stack), "--detach", check=True)
    again = dm.run("up", str(stack), "--detach")
    assert again.returncode == 1 and "already runs with state dir" in again.stderr
