"""`dynamod apply FILE` / `scale UNIT=N` on a real daemon: `up` of the edited file shows the
diff, a dry run changes nothing, scaling 1 -> 3 -> 2 leaves the untouched replicas' pids
alone, a changed command restarts the unit with it, a removed unit is stopped, an invalid
file changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import cli_inprocess
from tests.conftest import Dynamod, pid_alive, wait_dead

pytestmark = pytest.mark.slow

STACK = """
    [vars]
    workers = 1
    [units.base]
    command = ["{python}", "@PROC@", "serve", "{ports.http}"]
    ports = { http = 0 }
    ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", interval = 0.05 }
    [units.worker]
    replicas = "{vars.workers}"
    command = ["{python}", "@PROC@", "serve", "{ports.http}", "--name", "old"]
    ports = { http = 0 }
    depends_on = { base = "ready" }
    ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", interval = 0.05 }
    [units.side]
    command = ["{python}", "@PROC@", "serve", "{ports.http}"]
    ports = { http = 0 }
    ready = { kind = "http", url = "http://127.0.0.1:{ports.http}/health", interval = 0.05 }
"""
EDITED = STACK.replace('"--name", "old"', '"--name", "new"').split("[units.side]")[0]


def cli(dm: Dynamod, *args: str, code: int = 0) -> cli_inprocess.Result:
    """`dynamod ARGS` in this process (a subprocess costs seconds on a loaded machine):
    only for commands that ask the running daemon, never one that would start one."""
    result = cli_inprocess.run(["--state-dir", str(dm.state_dir), *args])
    assert result.code == code, f"dynamod {' '.join(args)}: {result}"
    return result


def pids(dm: Dynamod) -> dict[str, int]:
    return {u["name"]: u["pid"] for u in dm.status()["units"]}


def serving(dm: Dynamod) -> dict[str, Any]:
    return {u["name"]: u for u in dm.status()["units"] if u["state"] == "ready"}


def test_apply_and_scale_change_only_what_differs(dm: Dynamod, stack_file: Any) -> None:
    path: Path = stack_file(STACK)
    dm.run("up", str(path), "--detach", check=True)
    first = pids(dm)
    again = dm.run("up", str(path))  # the same file: refused as ever, no diff
    assert again.returncode == 1 and "already runs" in again.stderr
    assert "differs" not in again.stderr

    stack_file(EDITED)  # the running stack's own file, edited
    edited = dm.run("up", str(path))
    assert edited.returncode == 1 and f"{path} differs from it" in edited.stderr
    assert "~ worker@0: command changed (restarted)" in edited.stderr
    assert "- unit side" in edited.stderr and f"`dynamod apply {path}`" in edited.stderr

    dry = cli(dm, "apply", str(path), "--dry-run")
    assert "dry run: nothing was changed" in dry.stdout and "- unit side" in dry.stdout
    as_json = json.loads(cli(dm, "apply", str(path), "--dry-run", "--json").stdout)
    assert as_json["diff"]["removed"] == ["side"] and as_json["done"] == []
    assert as_json["diff"]["changed"] == {"worker@0": ["command"]}
    assert pids(dm) == first and "old" in dm.unit("worker@0")["command"]

    # scale 1 -> 3 -> 2 (of the running definition: the edit is not picked up by scale)
    up3 = cli(dm, "scale", "worker=3").stdout
    assert "+worker@1, +worker@2" in up3 and "done: started worker@1, worker@2" in up3
    three = pids(dm)
    assert {n: three[n] for n in first} == first and set(serving(dm)) >= {"worker@1", "worker@2"}
    down2 = cli(dm, "scale", "worker=2").stdout
    assert "done: stopped worker@2" in down2 and not wait_dead([three["worker@2"]])
    two = pids(dm)
    assert "worker@2" not in two and {n: two[n] for n in first} == first

    # an invalid file and an unknown unit change nothing (exit 2, one line)
    bad = stack_file(EDITED.replace("[units.base]", '[units.base]\n    comand = ["x"]'),
                     name="bad.toml")
    refused = cli(dm, "apply", str(bad), code=2)
    assert refused.stderr.strip().count("\n") == 0
    assert "nothing was changed" in refused.stderr and "unit 'base', field 'comand'" in refused.stderr
    unknown = cli(dm, "scale", "wroker=2", code=2)
    assert "did you mean worker" in unknown.stderr
    assert pids(dm) == two

    # the edit: both workers restarted one at a time with the new command (workers=2, as
    # `scale` set it, is kept); side stopped and gone; base untouched
    applied = cli(dm, "apply", str(path)).stdout
    assert "done: stopped side" in applied and "done: restarted worker@1 (command)" in applied
    after = pids(dm)
    assert "side" not in after and not wait_dead([two["side"]])
    assert after["base"] == first["base"] and pid_alive(after["base"])
    for name in ("worker@0", "worker@1"):
        assert after[name] != two[name] and dm.unit(name)["command"][-1] == "new"
        assert dm.unit(name)["state"] == "ready"
    assert cli(dm, "apply", str(path)).stdout.strip().endswith("no change")
    dm.run("down", check=True)
