"""Runbook files -> typed runbooks: every stock runbook loads, and bad files are refused
with the file, the runbook and the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.chaos import model
from dynamod.core.errors import SpecErrors

GOOD = """
[runbook]
name = "{name}"
description = "a test"
vars = {{ trainer_steps = 0 }}

[[steady_state]]
kind = "units_ready"

[load]
clients = 2
rate = 4

[[method]]
action = "kill"
unit = "worker@1"
signal = "term"

[[method]]
action = "wait_state"
unit = "worker@1"
new_pid = true

[[invariants]]
check = "client_errors"
max_error_rate = 0.1

[quick]
load_seconds = 5
"""


def write(tmp_path: Path, text: str, name: str = "rb") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_every_stock_runbook_loads_with_a_quick_profile_within_a_minute_of_load() -> None:
    runbooks = model.load_all()
    assert len(runbooks) >= 1
    for rb in runbooks:
        assert rb.quick.load_seconds <= 60 and rb.quick.repeat == 1, rb.name
        assert rb.invariants, rb.name


def test_the_real_engine_runbooks_load_on_the_vllm_cpu_stack() -> None:
    """runbooks/real-engine/ (make chaos-real-engine; CI runs the one that restarts no
    shard, in tests/integration/test_real_engine.py): valid, on real shards."""
    runbooks = model.load_all(model.runbooks_dir() / "real-engine")
    assert runbooks, "runbooks/real-engine/ holds the real engine's runbooks"
    for rb in runbooks:
        assert rb.stack_path() == "vllm-cpu" and rb.invariants, rb.name


def test_the_real_engine_runbooks_share_three_stacks() -> None:
    """One real shard start serves several runbooks: the one-shard group, the two-shard
    group (a push that one shard misses needs another to take it; a kill that costs no
    request needs another to take the load), shutdown's own."""
    from dynamod.chaos.runner import groups

    found = groups(model.load_all(model.runbooks_dir() / "real-engine"))
    assert [[b.name for b in g] for g in found] == [
        ["real-cache-reuse-after-update", "real-pauser-dies", "real-token-alignment",
         "real-worker-hang", "real-worker-sigkill"],
        ["real-shutdown-leaves-nothing"],
        ["real-stale-shard", "real-two-shards-sigkill", "real-worker-dies-during-update"],
    ]


def test_good_runbook_is_typed_and_signals_normalised(tmp_path: Path) -> None:
    rb = model.load(write(tmp_path, GOOD.format(name="rb")))
    kill, wait = rb.method
    assert isinstance(kill, model.KillStep) and kill.signal == "SIGTERM"
    assert isinstance(wait, model.WaitStateStep) and wait.new_pid
    assert rb.load is not None and rb.load.clients == 2
    assert rb.profile(model.Profile.QUICK).load_seconds == 5
    assert rb.stack_path() == "local"


def test_stack_path_is_relative_to_the_runbook(tmp_path: Path) -> None:
    text = GOOD.format(name="rb").replace('description = "a test"',
                                          'description = "a test"\nstack = "stacks/x.toml"')
    rb = model.load(write(tmp_path, text))
    assert rb.stack_path() == str(tmp_path / "stacks" / "x.toml")


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        (('signal = "term"', 'signal = "SIGNOPE"'), "method.0.signal", "unknown signal"),
        (('action = "kill"', 'action = "explode"'), "method.0", "unknown action"),
        (('max_error_rate = 0.1', 'max_error_rate = 3'), "invariants.0.max_error_rate",
         "less than or equal to 1"),
        (('check = "client_errors"', 'check = "vibes"'), "invariants.0.check", "Input should"),
        (('clients = 2', 'clients = 2\nburst = 9'), "load.burst", "unknown key"),
        (('unit = "worker@1"\nsignal', 'signal'), "method.0.unit", "required but missing"),
    ],
)
def test_bad_runbook_names_file_runbook_and_field(
    tmp_path: Path, change: tuple[str, str], field: str, message: str
) -> None:
    text = GOOD.format(name="rb")
    assert change[0] in text
    path = write(tmp_path, text.replace(change[0], change[1], 1))
    with pytest.raises(SpecErrors) as err:
        model.load(path)
    text_err = str(err.value)
    assert str(path) in text_err and "runbook 'rb'" in text_err
    assert f"field {field!r}" in text_err and message in text_err


def test_name_must_match_file_and_unknown_tables_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecErrors, match="must match the file name 'other'"):
        model.load(write(tmp_path, GOOD.format(name="rb"), name="other"))
    with pytest.raises(SpecErrors, match="field 'hypothesis': unknown table"):
        model.load(write(tmp_path, GOOD.format(name="rb") + "\n[hypothesis]\nx = 1\n"))
    with pytest.raises(SpecErrors, match="not valid TOML"):
        model.load(write(tmp_path, "[runbook\n"))
    with pytest.raises(SpecErrors, match="field 'runbook': required but missing"):
        model.load(write(tmp_path, "[load]\nclients = 1\n"))


def test_cli_lists_runbooks_and_refuses_a_bad_one_with_status_2(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dynamod.control.cli import main

    write(tmp_path, GOOD.format(name="good"), name="good")
    cli = CliRunner()
    listed = cli.invoke(main, ["chaos", "list", "--runbooks", str(tmp_path)])
    assert listed.exit_code == 0 and listed.output.startswith("good ")
    assert len(listed.output.splitlines()) == 1
    write(tmp_path, GOOD.format(name="bad").replace("clients = 2", "clients = 0"), name="bad")
    refused = cli.invoke(main, ["chaos", "run", "bad", "--runbooks", str(tmp_path)])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "bad.toml, runbook 'bad', field 'load.clients'" in refused.output
    nothing = cli.invoke(main, ["chaos", "run"])
    assert nothing.exit_code == 2 and "--all" in nothing.output


def test_runbooks_on_the_same_stack_vars_and_env_share_one_stack() -> None:
    from dynamod.chaos.runner import groups

    def rb(name: str, **kw: object) -> model.Runbook:
        return model.Runbook.model_validate({
            "name": name, "description": "d", "method": [{"action": "wait", "seconds": 1}],
            "invariants": [{"check": "no_leftovers"}], "vars": {"trainer_steps": 0}, **kw})

    books = [rb("a"), rb("b", vars={"trainer_steps": 3}), rb("c"), rb("d", shared_stack=False),
             rb("e", env={"X": "1"}), rb("f"), rb("g", stack="other")]
    assert [[b.name for b in g] for g in groups(books)] == [
        ["a", "c", "f"], ["b"], ["d"], ["e"], ["g"]]
    assert [[b.name for b in g] for g in groups(books, share=False)] == [
        [b.name] for b in books]


def test_stock_runbooks_group_into_few_stacks() -> None:
    from dynamod.chaos.runner import groups

    shared = [g for g in groups(model.load_all()) if len(g) > 1]
    names = {b.name for g in shared for b in g}
    assert {"worker-sigkill", "stale-shard", "frontend-crash"} <= names
    assert "shutdown-leaves-nothing" not in names  # its verdict is its own `down`
