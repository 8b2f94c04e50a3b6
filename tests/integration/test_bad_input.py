"""Bad stacks are refused before anything starts, with file, unit and field named."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dynamod.core import limits, paths
from tests import hostile
from tests.conftest import ROOT, Dynamod

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


# ------------------------------------------------------------------ issue 9 §4, real CLI
#
# Every bad input: one line naming what is wrong, exit 2, nothing written, nothing spawned.
# These run the installed command as a new user would; tests/unit/test_bad_input_props.py
# runs the same properties over hundreds of examples in-process.


class Sandbox:
    """A fresh directory that is the CLI's cwd, HOME and XDG dirs; each run carries a
    marker in its environment, so anything it spawned can be found afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.sentinel = root / hostile.SENTINEL_NAME
        self.marker = f"DYNAMOD_BADINPUT_PROBE={uuid.uuid4().hex}"
        for name in ("home", "cache", "runtime"):
            (root / name).mkdir()

    def run(self, *args: str, state_dir: Path | None = None,
            limit_memory: bool = False) -> subprocess.CompletedProcess[str]:
        key, value = self.marker.split("=")
        env = {**os.environ, key: value, "HOME": str(self.root / "home"),
               "XDG_CACHE_HOME": str(self.root / "cache"),
               "XDG_RUNTIME_DIR": str(self.root / "runtime")}
        env.pop(paths.STATE_DIR_ENV, None)
        cmd = [sys.executable, "-m", "dynamod", "--state-dir",
               str(state_dir or self.state_dir), *args]

        def one_gib() -> None:  # a stack that tried to exhaust memory would die here
            resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=self.root,
                              env={**env, "PYTHONPATH": str(ROOT)},
                              preexec_fn=one_gib if limit_memory else None)

    def refused(self, *args: str, expect: str, state_dir: Path | None = None,
                limit_memory: bool = False) -> str:
        before = hostile.tree(self.root)
        result = self.run(*args, state_dir=state_dir, limit_memory=limit_memory)
        hostile.assert_refused(result.returncode, result.stderr, result.stdout, expect)
        assert hostile.tree(self.root) == before, "a refused command changed files"
        assert not self.sentinel.exists(), "a unit was started"
        assert hostile.marked_processes(self.marker) == [], "a refused command left a process"
        return result.stderr


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def write(box: Sandbox, text: str | bytes, name: str = "stack.toml") -> Path:
    path = box.root / name
    path.write_bytes(text if isinstance(text, bytes) else textwrap.dedent(text).encode())
    return path


def test_stack_path_that_is_a_directory(box: Sandbox) -> None:
    (box.root / "stacks").mkdir()
    for command in ("check", "up"):
        err = box.refused(command, str(box.root / "stacks"), expect="is a directory")
        assert err.count("\n") == 1


def test_stack_file_that_is_not_utf8(box: Sandbox) -> None:
    stack = write(box, b'[units.a]\ncommand = ["caf\xe9"]\n')
    err = box.refused("up", str(stack), "--detach", expect="not UTF-8")
    assert f"{stack}: not UTF-8 text: byte 0xe9 at line 2, column 16" in err


def test_huge_replica_count_is_a_limit_not_an_oom_kill(box: Sandbox) -> None:
    stack = write(box, f"""
        [units.a]
        replicas = 100000000000
        command = ["touch", "{box.sentinel}"]
    """)
    err = box.refused("check", str(stack), expect="field 'replicas'", limit_memory=True)
    assert f"must be between 0 and {limits.MAX_INSTANCES}, got 100000000000" in err


def test_include_of_dev_zero_and_of_itself(box: Sandbox) -> None:
    stack = write(box, '[stack]\ninclude = ["/dev/zero"]\n')
    box.refused("check", str(stack), expect="include /dev/zero: is a character device")
    write(box, '[stack]\ninclude = ["stack.toml"]\n')
    box.refused("check", str(stack), expect="include cycle")


def test_state_dir_under_a_file_or_too_long(box: Sandbox) -> None:
    stack = write(box, f'[units.a]\ncommand = ["touch", "{box.sentinel}"]\ntype = "oneshot"\n')
    blocker = write(box, "not a directory\n", name="blocker")
    cases = {blocker / "state": f"cannot be created: {blocker} is not a directory",
             box.root / ("d" * 120): "too deep for a unix socket path"}
    for state_dir, expect in cases.items():
        for args in (["check", str(stack)], ["up", str(stack), "--detach"], ["status"]):
            box.refused(*args, state_dir=state_dir, expect=expect)


def test_state_dir_on_a_read_only_mount(box: Sandbox) -> None:
    stack = write(box, f'[units.a]\ncommand = ["touch", "{box.sentinel}"]\ntype = "oneshot"\n')
    mount = box.root / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                          capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr!r}")
    try:
        for args in (["check", str(stack)], ["up", str(stack), "--detach"]):
            box.refused(*args, state_dir=mount / "state",
                        expect=f"cannot be created: {mount} is not writable")
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_stacks_through_the_real_cli(box: Sandbox, data: st.DataObject) -> None:
    case = data.draw(hostile.invalid_stack(box.sentinel))
    for name, content in case.files.items():
        write(box, content, name)
    box.refused("up", str(box.root / "stack.toml"), "--detach", expect=case.expect)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.one_of(
    hostile.bad_var.map(lambda v: ["up", "local", "--var", v]),
    hostile.bad_seconds_arg.map(lambda v: ["up", "local", "--detach", "--timeout", v]),
    hostile.bad_metrics_addr.map(lambda v: ["up", "local", "--metrics-addr", v]),
    hostile.bad_instance_name.map(lambda n: ["restart", n]),
))
def test_hostile_arguments_through_the_real_cli(box: Sandbox, args: list[str]) -> None:
    assume(not any("\0" in a for a in args))  # argv cannot carry a NUL; in-process tests can
    box.refused(*args, expect="dynamod")


_CHECK, _UP = ["check", "local"], ["up", "local", "--detach"]
_EXPORT = ["export", "supervisord", "local", "--out", "{out}/supervisord.conf"]
_SYSTEMD = ["systemd", "generate", "local", "--out", "{out}"]


# every command that reads --var, and every kind of typo (one command each: they share
# the one check, so the product would only cost time)
@pytest.mark.parametrize("command, var, hint", [
    (_CHECK, "worker=4", "did you mean `workers`"),
    (_UP, "worker=4", "did you mean `workers`"),
    (_EXPORT, "worker=4", "did you mean `workers`"),
    (_SYSTEMD, "worker=4", "did you mean `workers`"),
    (_CHECK, "Workers=3", "did you mean `workers`"),
    (_UP, "trainer_step=0", "did you mean `trainer_steps`"),
])
def test_an_unknown_var_is_refused_naming_it_the_stack_and_the_closest_names(
    dm: Dynamod, tmp_path: Path, command: list[str], var: str, hint: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = [a.format(out=out) for a in command]
    result = dm.run(*args, "--var", "workers=1", "--var", var)
    assert result.returncode == 2, result.stderr
    name = var.partition("=")[0]
    stack = paths.units_dir() / "stacks" / "local.toml"
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"no variable {name!r}" in result.stderr and hint in result.stderr
    assert str(stack) in result.stderr and "Traceback" not in result.stderr
    assert list(out.iterdir()) == [] and result.stdout == ""
    assert_nothing_started(dm)


# a var with a declared format (`[var_formats]`), through each command that resolves the
# stack: refused before anything starts, not as the program's own failure once it runs
@pytest.mark.parametrize("command, var, expect", [
    (_UP, "etcd_history=bogus", "field '--var etcd_history': must be a duration"),
    (_CHECK, "etcd_history=-1h", "field '--var etcd_history': must be a duration"),
    (_EXPORT, "dynamo_lease_ttl=0", "must be a whole number of seconds above 0, got 0"),
    (_SYSTEMD, "migration_limit=-1", "must be a whole number, 0 or more, got -1"),
])
def test_a_var_that_is_not_its_format_is_refused_before_anything_starts(
    dm: Dynamod, tmp_path: Path, command: list[str], var: str, expect: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = dm.run(*[a.format(out=out) for a in command], "--var", var)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and expect in result.stderr, result.stderr
    assert str(paths.units_dir() / "stacks" / "local.toml") in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert list(out.iterdir()) == []
    assert_nothing_started(dm)
