"""Preflight refuses what would only fail at spawn time, naming the unit; the hidden
`systemd wait-ready` refuses a bad probe in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dynamod.core import preflight, spec
from dynamod.core.errors import PreflightError
from tests import cli_inprocess


def stack(tmp_path: Path, unit: str) -> spec.Stack:
    path = tmp_path / "stack.toml"
    path.write_text(f"[units.a]\n{unit}\n")
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "s", allocate_port=lambda: next(counter))


def test_missing_cwd_is_named_before_spawning(tmp_path: Path) -> None:
    resolved = stack(tmp_path, f'command = ["true"]\ncwd = "{tmp_path}/nope"')
    with pytest.raises(PreflightError) as info:
        preflight.check(resolved, [])
    assert str(info.value) == (
        f"cannot start the stack: {tmp_path}/stack.toml: unit 'a': cwd '{tmp_path}/nope' is "
        "not an existing directory"
    )
    preflight.check(stack(tmp_path, f'command = ["true"]\ncwd = "{tmp_path}"'), [])


def test_a_directory_is_not_an_executable(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=f"command '{tmp_path}' is not installed"):
        preflight.check(stack(tmp_path, f'command = ["{tmp_path}"]'), [])


def test_wait_ready_refuses_a_bad_probe_in_one_line() -> None:
    result = cli_inprocess.run(["systemd", "wait-ready", '{"kind": "tcp", "port": "x"}'])
    assert result.code == 2
    assert result.stderr.count("\n") == 1
    assert "not a readiness probe: port: Input should be a valid integer" in result.stderr


def test_unknown_stock_stack_lists_the_stock_ones(tmp_path: Path) -> None:
    result = cli_inprocess.run(["--state-dir", str(tmp_path / "s"), "check", "nosuch"])
    assert result.code == 2
    listed = "no stock stack 'nosuch' (stock stacks: cluster, cluster-ha, infra, local"
    assert listed in result.stderr
