"""`dynamod apply FILE` / `scale UNIT=N` on a real daemon: `up` of the edited file shows the
diff, a dry run changes nothing, scaling 1 -> 3 -> 2 leaves the untouched replicas' pids
alone, a changed command restarts the unit with it, a removed unit is stopped, an invalid
file changes nothing."""

from __future__ import annotations

import json
import os
import time
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
    assert "nothing was changed" in refused.stderr
    assert "unit 'base', field 'comand'" in refused.stderr
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


# The CPU-worker stack costs ~35 s more (measured on a loaded 2-core machine): outside the CI
# suite, run by `make test-apply-shards` (DYNAMOD_TEST_APPLY_SHARDS=1).
@pytest.mark.skipif(os.environ.get("DYNAMOD_TEST_APPLY_SHARDS") != "1",
                    reason="the CPU-worker stack: `make test-apply-shards` runs it")  # fmt: skip
def test_scaled_shards_are_replayed_before_routed_and_drained_before_stopped(
    dm: Dynamod, tmp_path: Path
) -> None:
    """The CPU-worker stack (real etcd, NATS, Dynamo frontend, our CPU worker) at policy v1:
    `scale worker=2` admits the new shard only once it holds v1 and the router routes v1 to
    it; `scale worker=1` drains it (out of routing, its requests finished: none failed)
    before it stops; a change that would leave fewer admitted shards than min_ready_shards
    is refused at once."""
    from tests.integration.policystack import History, checkpoint, frontend, model_dir, push
    from tests.integration.policystack import write_stack as policy_stack

    stack = policy_stack(tmp_path / "apply-stack.toml", "applytest", workers=1)
    dm.run("up", str(stack), "--detach", timeout=300, check=True)
    status = dm.status()
    push(dm, 1, checkpoint(model_dir(status), tmp_path / "step-1", 1.01))
    history = History(frontend(status))
    history.run(lambda: 1)  # trainer traffic: it requires v1's taint
    try:
        history.wait_served(8)
        scaled = cli(dm, "scale", "worker=2").stdout
        assert "done: started worker@1" in scaled
        new = dm.unit("worker@1")
        assert new["state"] == "ready" and new["policy_version"] == 1
        assert new["policy"]["routed_version"] == 1 and new["policy"]["admitted"]
        events = [json.loads(line) for line in
                  (dm.state_dir / "events.jsonl").read_text().splitlines()]  # fmt: skip
        moves = [e["to"] for e in events if e["kind"] == "state" and e["unit"] == "worker@1"]
        assert moves[:3] == ["starting", "held", "ready"], moves  # held (replayed), then ready
        history.wait_served(8, after=time.monotonic())
        instance = new["dynamo"]["instance_ids"][0]
        by_new = [r for r in history.rows if r.get("instance") == instance]
        assert by_new and {r["version"] for r in by_new} == {1}

        edited = policy_stack(tmp_path / "apply-stack.toml", "applytest", workers=2,
                              min_ready_shards=2)  # fmt: skip
        before = pids(dm)
        refused = cli(dm, "apply", str(edited), "--var", "weight_ipc_dir=/nonexistent", code=1)
        assert "min_ready_shards=2" in refused.stderr and "done before: nothing" in refused.stderr
        assert pids(dm) == before
        # back: the env as it runs, min_ready_shards 1 (only the [policy] table changes)
        back = policy_stack(tmp_path / "apply-stack.toml", "applytest")
        again = cli(dm, "apply", str(back), "--var", "weight_ipc_dir=", "--json")
        assert json.loads(again.stdout)["diff"]["changed"] == {} and pids(dm) == before
        down = cli(dm, "scale", "worker=1").stdout
        assert "done: stopped worker@1" in down
    finally:
        history.stop()
    drained = [e for e in (json.loads(line) for line in
               (dm.state_dir / "events.jsonl").read_text().splitlines())
               if e["kind"] == "shard.drained"]  # fmt: skip
    assert [(e["unit"], e["outcome"].split(":")[0]) for e in drained] == [("worker@1", "drained")]
    failed = [r for r in history.rows if r["status"] != 200]
    assert failed == [], [(r["sent"] - history.rows[0]["sent"], r.get("error")) for r in failed[:3]]
    dm.run("down", check=True)
