"""Property-based: hostile stack files, names, templates, variables and CLI arguments go
through the real CLI's validation (in-process, see tests/cli_inprocess.py) and end in exit 0
(it happened to be valid) or exit 2 with one clear line, never a traceback, and nothing is
written or spawned. The real-subprocess examples are in tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamod.core import limits
from tests import cli_inprocess, hostile

FAST = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass
class Sandbox:
    root: Path
    state_dir: Path  # never created by a refused command
    sentinel: Path  # a unit that ran would create it

    def write(self, files: dict[str, bytes]) -> Path:
        for name, data in files.items():
            (self.root / name).write_bytes(data)
        return self.root / "stack.toml"


def _children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as fh:
            found |= {int(p) for p in fh.read().split()}
    return found


@contextmanager
def sandbox() -> Iterator[Sandbox]:
    """A fresh directory; on exit, asserts nothing in it changed except what the test
    wrote, that no child process was left, and that no unit ever ran."""
    root = Path(tempfile.mkdtemp(prefix="dm-bad-", dir="/tmp"))
    box = Sandbox(root, root / "state", root / hostile.SENTINEL_NAME)
    children = _children()
    try:
        yield box
        assert not box.state_dir.exists(), "a refused command created the state dir"
        assert not box.sentinel.exists(), "a unit was started"
        assert _children() <= children, "a refused command left a child process"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check(box: Sandbox, stack: Path, *extra: str) -> cli_inprocess.Result:
    before = hostile.tree(box.root)
    result = cli_inprocess.run(["--state-dir", str(box.state_dir), "check", str(stack), *extra])
    assert hostile.tree(box.root) == before, "check wrote a file"
    return result


@settings(FAST, max_examples=40)
@given(hostile.hostile_stack_tables)
def test_hostile_stack_files_are_valid_or_refused_in_one_line(tables: dict[str, object]) -> None:
    with sandbox() as box:
        stack = box.write({"stack.toml": hostile.toml_document(tables).encode()})
        result = _check(box, stack)
        if result.code != 0:
            hostile.assert_refused(result.code, result.stderr, result.stdout)


@FAST
@given(st.binary(max_size=600))
def test_garbage_bytes_are_valid_or_refused_in_one_line(data: bytes) -> None:
    with sandbox() as box:
        stack = box.write({"stack.toml": data})
        result = _check(box, stack)
        if result.code != 0:
            hostile.assert_refused(result.code, result.stderr, result.stdout, str(stack))


@FAST
@given(st.data())
def test_invalid_stacks_are_refused_naming_the_field(data: st.DataObject) -> None:
    with sandbox() as box:
        case = data.draw(hostile.invalid_stack(box.sentinel))
        stack = box.write(case.files)
        for command in ("check", "up"):
            before = hostile.tree(box.root)
            result = cli_inprocess.run(
                ["--state-dir", str(box.state_dir), command, str(stack)]
            )
            hostile.assert_refused(result.code, result.stderr, result.stdout, case.expect)
            assert str(stack) in result.stderr
            assert hostile.tree(box.root) == before


@FAST
@given(
    template=st.lists(st.sampled_from(hostile.HOSTILE_STRINGS) | st.text(max_size=6), max_size=8)
    .map("".join),
    var_value=hostile.hostile_text,
    repeat=st.integers(min_value=0, max_value=3),
)
def test_hostile_templates_and_vars(template: str, var_value: str, repeat: int) -> None:
    """A self-referencing or unknown reference, stray braces, repeated expansion: either
    the rendered command is within the limit, or the refusal names the field."""
    with sandbox() as box:
        tables = {
            "vars": {"a": "{vars.a}" * repeat + var_value, "b": template},
            "units": {"u": {"command": ["true", template, "{vars.b}"], "type": "oneshot"}},
        }
        stack = box.write({"stack.toml": hostile.toml_document(tables).encode()})
        result = _check(box, stack, "--var", f"a={var_value}")
        if result.code != 0:
            hostile.assert_refused(result.code, result.stderr, result.stdout, str(stack))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_bad_cli_arguments_exit_2_with_one_line(data: st.DataObject) -> None:
    with sandbox() as box:
        case = data.draw(hostile.invalid_stack(box.sentinel))
        stack = str(box.write(case.files))  # so even an accepted option starts nothing
        args = data.draw(
            st.one_of(
                hostile.bad_var.map(lambda v: ["up", stack, "--var", v]),
                hostile.bad_seconds_arg.map(lambda v: ["up", stack, "--detach", "--timeout", v]),
                hostile.bad_metrics_addr.map(lambda v: ["up", stack, "--metrics-addr", v]),
                hostile.bad_instance_name.map(lambda n: ["logs", n]),
                hostile.bad_instance_name.map(lambda n: ["restart", n]),
                hostile.bad_count_arg.map(lambda n: ["logs", "a", "-n", n]),
                hostile.bad_count_arg.map(lambda n: ["policy", "push", "--step", n, "--path", "x"]),
                hostile.bad_count_arg.map(
                    lambda n: ["systemd", "generate", stack, "--watchdog-sec", n, "--out", stack]
                ),
                st.sampled_from(
                    [["nosuch"], ["check", "--bogus"], ["policy", "nosuch"], ["restart"]]
                ),
            )
        )
        before = hostile.tree(box.root)
        result = cli_inprocess.run(["--state-dir", str(box.state_dir), *args])
        hostile.assert_refused(result.code, result.stderr, result.stdout)
        assert hostile.tree(box.root) == before


@settings(max_examples=40, deadline=None)
@given(
    key=st.sampled_from(["workers", "router_mode", "model_dir", "trainer_steps", "namespace"]),
    value=hostile.hostile_text | hostile.hostile_number.map(str),
)
def test_hostile_vars_on_the_stock_stack(key: str, value: str) -> None:
    with sandbox() as box:
        result = cli_inprocess.run(
            ["--state-dir", str(box.state_dir), "check", "local", "--var", f"{key}={value}"]
        )
        if result.code != 0:
            hostile.assert_refused(result.code, result.stderr, result.stdout)


COMMANDS = [
    ["check", "local"],
    ["up", "local", "--detach"],
    ["down"],
    ["status"],
    ["logs", "etcd"],
    ["restart", "etcd"],
    ["policy", "status"],
    ["export", "supervisord", "local"],
    ["cluster", "forget", "n2"],
]


@settings(max_examples=40, deadline=None)
@given(
    how=st.sampled_from(["under-a-file", "is-a-file", "too-long"]),
    command=st.sampled_from(COMMANDS),
)
def test_unusable_state_dir_is_refused_by_every_command(how: str, command: list[str]) -> None:
    with sandbox() as box:
        blocker = box.root / "blocker"
        blocker.write_text("a file where a directory should be\n")
        state_dir = {
            "under-a-file": blocker / "state",
            "is-a-file": blocker,
            "too-long": box.root / ("d" * 120),
        }[how]
        before = hostile.tree(box.root)
        result = cli_inprocess.run(["--state-dir", str(state_dir), *command])
        hostile.assert_refused(result.code, result.stderr, result.stdout, "state dir")
        assert hostile.tree(box.root) == before


@settings(max_examples=100, deadline=None)
@given(hostile.valid_unit_name, st.integers(min_value=0, max_value=limits.MAX_INSTANCES - 1))
def test_every_name_a_stack_can_define_is_a_name_the_cli_accepts(name: str, index: int) -> None:
    """`logs` and `restart` check UNIT with limits.is_instance_name; a name the spec
    accepts must never be refused there."""
    assert limits.is_instance_name(name)
    assert limits.is_instance_name(f"{name}@{index}")
