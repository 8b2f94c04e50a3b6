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
from tests.conftest import Dynamod, pid_alive, unit_by_name, wait_dead

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
    formats = stack_file(EDITED.replace('    workers = 1\n', '    workers = 1\n    [var_formats]\n'
                                        '    workers = "count"\n'), name="formats.toml")
    negative = cli(dm, "apply", str(formats), "--var", "workers=-1", code=2).stderr
    assert negative.strip().count("\n") == 0 and "nothing was changed" in negative
    assert "field '--var workers': must be a whole number, 0 or more, got -1" in negative
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


# The CPU-worker stack costs ~35 s more (measured on a loaded 2-core machine), its spares
# case ~30 s more: outside the CI suite, run by `make test-apply-shards`
# (DYNAMOD_TEST_APPLY_SHARDS=1).
SHARDS_CASE = pytest.mark.skipif(os.environ.get("DYNAMOD_TEST_APPLY_SHARDS") != "1",
                                 reason="the CPU-worker stack: `make test-apply-shards` runs it")


def events(dm: Dynamod, kind: str) -> list[dict[str, Any]]:
    rows = (json.loads(line) for line in (dm.state_dir / "events.jsonl").read_text().splitlines())
    return [e for e in rows if e["kind"] == kind]


def failures(
    *histories: Any, since: float = 0.0, until: float = float("inf")
) -> list[tuple[Any, float, Any]]:
    """(required version, seconds into the run, error) of each request sent from `since`
    to `until` (monotonic) that failed."""
    return [(r["required"], round(r["sent"] - h.rows[0]["sent"], 2), r.get("error"))
            for h in histories for r in h.rows
            if r["status"] != 200 and since <= r["sent"] < until]  # fmt: skip


def loaded_policy_stack(dm: Dynamod, path: Path, name: str) -> tuple[Any, Any]:
    """`up` of the CPU-worker policy stack with one shard, pushed to v1, under trainer
    traffic (v1's taint required) and plain traffic (no constraint), both served."""
    from tests.integration.policystack import History, checkpoint, frontend, model_dir, push
    from tests.integration.policystack import write_stack as policy_stack

    dm.run("up", str(policy_stack(path, name, workers=1)), "--detach", timeout=300, check=True)
    status = dm.status()
    push(dm, 1, checkpoint(model_dir(status), path.parent / "step-1", 1.01))
    trainer, plain = History(frontend(status)), History(frontend(status))
    trainer.run(lambda: 1, rate=6)
    plain.run(lambda: None, rate=6)
    trainer.wait_served(6)
    plain.wait_served(6)
    return trainer, plain


@SHARDS_CASE
def test_scaled_shards_are_replayed_before_routed_and_drained_before_stopped(
    dm: Dynamod, tmp_path: Path
) -> None:
    """The CPU-worker stack (real etcd, NATS, Dynamo frontend, our CPU worker) at policy v1,
    under trainer traffic (v1's taint required) and plain traffic (no constraint):
    `scale worker=2` admits the new shard only once it holds v1 and the router routes v1 to
    it; `scale worker=1` drains it (out of the frontend's routing first: no request of
    either kind reaches it after, its in-flight ones finished: none failed) before it
    stops; a change that would leave fewer admitted shards than min_ready_shards is
    refused at once. Then [policy] spares: see the next part."""
    from tests.integration.policystack import write_stack as policy_stack

    trainer, plain = loaded_policy_stack(dm, tmp_path / "apply-stack.toml", "applytest")
    try:
        scaled = cli(dm, "scale", "worker=2").stdout
        assert "done: started worker@1" in scaled
        new = dm.unit("worker@1")
        assert new["state"] == "ready" and new["policy_version"] == 1
        assert new["policy"]["routed_version"] == 1 and new["policy"]["admitted"]
        moves = [e["to"] for e in events(dm, "state") if e["unit"] == "worker@1"]
        assert moves[:3] == ["starting", "held", "ready"], moves  # held (replayed), then ready
        trainer.wait_served(8, after=time.monotonic())
        instance = new["dynamo"]["instance_ids"][0]
        by_new = [r for r in trainer.rows if r.get("instance") == instance]
        assert by_new and {r["version"] for r in by_new} == {1}

        # `stop` takes a shard out as the scale-down below does (out of the frontend's
        # routing, drained, then stopped); `start` brings it back through a replay
        assert "worker@1 stopped" in cli(dm, "stop", "worker@1").stdout
        trainer.wait_served(4, after=time.monotonic())
        assert "worker@1 started" in cli(dm, "start", "worker@1").stdout
        back = dm.wait_for(
            lambda s: (u := unit_by_name(s, "worker@1"))["state"] == "ready"
            and u["policy"]["admitted"] and u,
            timeout=120, what="worker@1 admitted again",
        )  # fmt: skip
        assert back["policy_version"] == 1
        [by_stop] = events(dm, "dynamo.withdrawn")
        assert by_stop["unit"] == "worker@1" and "dynamod stop" in by_stop["why"], by_stop
        late = [r for r in trainer.rows + plain.rows if r.get("instance") == instance
                and r["sent"] > by_stop["mono"]]  # fmt: skip
        assert late == [], f"{len(late)} request(s) sent after the stop's withdrawal reached it"
        instance = back["dynamo"]["instance_ids"][0]

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
        plain.wait_served(8, after=time.monotonic())
        assert any(r.get("instance") == instance for r in plain.rows), "plain never reached it"
        down = cli(dm, "scale", "worker=1").stdout
        assert "done: stopped worker@1" in down
        trainer.wait_served(4, after=time.monotonic())
    finally:
        trainer.stop()
        plain.stop()
    [_, withdrawn] = events(dm, "dynamo.withdrawn")  # the stop's, then the scale-down's
    assert withdrawn["unit"] == "worker@1" and withdrawn["frontends"] == "dropped by 1 frontend(s)"
    drained = events(dm, "shard.drained")
    assert [(e["unit"], e["outcome"].split(":")[0]) for e in drained] == [
        ("worker@1", "drained"), ("worker@1", "drained")]  # fmt: skip
    assert failures(trainer, plain) == []
    late = [r for r in plain.rows if r.get("instance") == instance
            and r["sent"] > withdrawn["mono"]]  # fmt: skip
    assert late == [], f"{len(late)} plain request(s) sent after the withdrawal reached it"
    dm.run("down", check=True)


@SHARDS_CASE
def test_apply_of_a_spares_change_gives_roles_as_the_policy_table_says(
    dm: Dynamod, tmp_path: Path
) -> None:
    """[policy] spares changed by `apply` on the CPU-worker stack, under traffic of both
    kinds: spares 0 -> 1 adds worker@1 as a spare (replayed to v1, no trainer traffic);
    after a restart of worker@0 swapped the roles (worker@1 serves, worker@0 is the spare),
    spares 1 -> 0 removes worker@1, the highest index, a serving shard: worker@0 is
    promoted first, then worker@1 drained and stopped; one shard serves throughout."""
    from tests.integration.policystack import write_stack as policy_stack

    path = tmp_path / "spares-stack.toml"
    trainer, plain = loaded_policy_stack(dm, path, "sparestest")
    try:
        added = cli(dm, "apply", str(policy_stack(path, "sparestest", workers=1, spares=1)))
        assert "done: started worker@1" in added.stdout, added
        spare = dm.unit("worker@1")
        assert spare["spare"]["role"] == "spare" and spare["policy_version"] == 1, spare
        assert not spare["policy"]["admitted"] and dm.unit("worker@0")["spare"]["role"] == "serving"
        spare_id = spare["dynamo"]["instance_ids"][0]
        since = time.monotonic()
        trainer.wait_served(8, after=since)
        assert not [r for r in trainer.rows if r["sent"] > since and r.get("instance") == spare_id]

        first, restarted = pids(dm)["worker@0"], time.monotonic()
        cli(dm, "restart", "worker@0")  # its spare takes over; it comes back as the spare
        def swapped_roles(status: dict[str, Any]) -> bool:
            units = {u["name"]: u for u in status["units"]}
            back = units["worker@0"]
            return (units["worker@1"].get("spare", {}).get("role") == "serving"
                    and back.get("spare", {}).get("role") == "spare"
                    and back["state"] == "ready" and back["pid"] != first)  # fmt: skip

        dm.wait_for(swapped_roles, timeout=60, what="worker@1 serving, worker@0 back as the spare")
        trainer.wait_served(6, after=time.monotonic())
        swapped = time.monotonic()
        removed = cli(dm, "apply", str(policy_stack(path, "sparestest", workers=1, spares=0)))
        assert "done: stopped worker@1" in removed.stdout, removed
        serving = dm.unit("worker@0")
        assert serving["policy"]["admitted"] and serving["spare"]["role"] == "serving", serving
        trainer.wait_served(6, after=time.monotonic())
        plain.wait_served(6, after=time.monotonic())
    finally:
        trainer.stop()
        plain.stop()
    promoted = [e for e in events(dm, "spares.promoted") if e["mono"] > swapped]
    assert [(e["unit"], e["reason"]) for e in promoted] == [("worker@0", "apply")], promoted
    [drain] = [e for e in events(dm, "shard.drained") if e["unit"] == "worker@1"]
    assert promoted[0]["mono"] < drain["mono"], "worker@1 was drained before its spare served"
    assert dm.status()["policy"]["spares"]["wanted"] == 0
    # (the restart's own window is not this test's: its stop is no drain)
    assert failures(trainer, plain, until=restarted) + failures(trainer, plain, since=swapped) == []
    dm.run("down", check=True)
