"""The `dynamod` group loads a command's module only when that command runs: each name in
the table is the command it loads, and `dynamod status` imports neither the stack models nor
the other command families (its start time is the fleet's status measure, issue 26)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from dynamod.control import commands


@pytest.mark.parametrize("name", list(commands.COMMANDS))
def test_each_name_loads_the_command_of_that_name(name: str) -> None:
    command = commands.load(name)
    assert isinstance(command, click.Command)
    assert command.name == name


def test_a_name_that_is_no_command_loads_nothing() -> None:
    assert commands.load("nosuch") is None


def test_status_imports_only_the_client_and_the_renderer(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from dynamod.control.cli import main\n"
        f"sys.argv = ['dynamod', '--state-dir', {str(tmp_path)!r}, 'status']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('dynamod.core.spec',\n"
        "    'dynamod.control.commands.', 'dynamod.chaos', 'dynamod.rollout', 'pydantic')))\n"
        "heavy = [m for m in heavy if m != 'dynamod.control.commands.units']\n"
        "print('EXIT', code, 'HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert "no dynamod daemon is running" in done.stderr, done.stderr
    assert last == "EXIT 1 HEAVY=", done.stderr
