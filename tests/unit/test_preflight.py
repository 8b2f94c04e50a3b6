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
    listed = "no stock stack 'nosuch' (stock stacks: cluster, cluster-ha, cluster-verl, infra"
    assert listed in result.stderr


def test_a_failing_preflight_command_refuses_with_its_last_stderr_line(tmp_path: Path) -> None:
    refuse = "import sys; print('noise', file=sys.stderr); sys.exit('vars.x: wrong, set --var x=Y')"
    unit = f'command = ["true"]\nreplicas = 3\npreflight = ["python3", "-c", "{refuse}"]'
    with pytest.raises(PreflightError) as info:
        preflight.check(stack(tmp_path, unit), [])
    # named once for the unit, not once per replica
    assert str(info.value) == (
        f"cannot start the stack: {tmp_path}/stack.toml: unit 'a': vars.x: wrong, set --var x=Y"
    )
    preflight.check(stack(tmp_path, 'command = ["true"]\npreflight = ["true"]'), [])


def test_a_missing_command_of_replicas_is_named_once(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as info:
        preflight.check(stack(tmp_path, 'command = ["/nope/python"]\nreplicas = 2'), [])
    assert "\n" not in str(info.value) and "unit 'a': command '/nope/python'" in str(info.value)


def vllm_check(tmp_path: Path, *var: str) -> cli_inprocess.Result:
    args = ["--state-dir", str(tmp_path / "s"), "check", "vllm-cpu"]
    return cli_inprocess.run([*args, *(a for v in var for a in ("--var", v))])


def test_vllm_stack_refuses_a_model_vllm_cannot_serve(tmp_path: Path, tiny_dir: Path) -> None:
    venv_python = tmp_path / "venv" / "python"
    venv_python.parent.mkdir()
    venv_python.symlink_to("/bin/true")
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    (narrow / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    result = vllm_check(tmp_path, f"vllm_python={venv_python}", f"model_dir={narrow}")
    assert result.code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"vars.model_dir: {narrow}/config.json has head_dim 16" in result.stderr
    assert "set --var model_dir=DIR" in result.stderr
    (narrow / "config.json").unlink()
    result = vllm_check(tmp_path, f"vllm_python={venv_python}", f"model_dir={narrow}")
    assert result.code == 2 and f"vars.model_dir: {narrow} has no config.json" in result.stderr
    # the tiny model fits
    result = vllm_check(tmp_path, f"vllm_python={venv_python}", f"model_dir={tiny_dir}")
    assert result.code == 0, result.stderr


def test_vllm_stack_refuses_a_missing_venv_naming_the_var(tmp_path: Path) -> None:
    result = vllm_check(tmp_path, f"vllm_python={tmp_path}/no-venv/bin/python", "shards=2")
    assert result.code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"command '{tmp_path}/no-venv/bin/python' is not installed" in result.stderr
    assert "scripts/install-vllm.sh" in result.stderr and "--var vllm_python=" in result.stderr
