"""The diff of two resolved stacks (`apply`, `scale`, `up` of an edited file) and the
stack a running one would become: ports kept, `--var`s kept, replicas scaled."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.core import spec
from dynamod.core.errors import SpecErrors, UnknownUnit
from dynamod.core.spec import change
from dynamod.core.spec.diff import StackDiff, diff, lines
from dynamod.rollout import tables

BASE = """
    [vars]
    workers = 2
    [units.etcd]
    command = ["etcd", "--port", "{ports.client}"]
    ports = { client = 0 }
    [units.worker]
    replicas = "{vars.workers}"
    command = ["w", "--etcd", "{units.etcd.ports.client}"]
    ports = { system = 0 }
    depends_on = { etcd = "started" }
    [units.plain]
    replicas = 1
    command = ["p"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(textwrap.dedent(text))
    return path


def ports() -> spec.PortAllocator:
    counter = itertools.count(40000)
    return lambda: next(counter)


def load(tmp_path: Path, text: str, **var: object) -> spec.Stack:
    tables.register()
    return spec.load(write(tmp_path, text), state_dir=tmp_path / "state",
                     allocate_port=ports(), var_overrides=var)  # fmt: skip


def reread(tmp_path: Path, running: spec.Stack, text: str, **var: object) -> spec.Stack:
    counter = itertools.count(50000)
    return change.reread(write(tmp_path, text), running, var, allocate_port=lambda: next(counter))


def bases(*stacks: spec.Stack) -> dict[str, str]:
    return {n: u.unit for s in stacks for n, u in s.units.items()}


def test_same_file_is_no_change_and_keeps_every_port(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    again = reread(tmp_path, running, BASE)
    assert diff(running, again).empty
    assert {n: u.ports for n, u in again.units.items()} == {
        n: u.ports for n, u in running.units.items()}
    assert lines(diff(running, again), {}) == ["no change"]


def test_more_workers_adds_replicas_and_changes_nothing_else(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    bigger = reread(tmp_path, running, BASE, workers=4)
    change_ = diff(running, bigger)
    assert change_.added == ["worker@2", "worker@3"] and not change_.removed
    assert change_.changed == {} and change_.replicas == {"worker": (2, 4)}
    assert change_.vars == {"workers": (2, 4)}
    assert bigger.units["worker@2"].ports["system"] >= 50000  # a new port, the old ones kept
    text = lines(change_, bases(running, bigger))
    assert "~ worker: replicas 2 -> 4 (+worker@2, +worker@3)" in text
    assert "~ var workers: 2 -> 4" in text


def test_edited_command_env_and_removed_unit(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    edited = BASE.replace('command = ["p"]', 'command = ["p", "-v"]\nenv = { A = "1" }')
    edited = edited.replace('"w", "--etcd"', '"w2", "--etcd"')
    new = reread(tmp_path, running, edited)
    change_ = diff(running, new)
    assert change_.changed == {"worker@0": ["command"], "worker@1": ["command"],
                               "plain@0": ["command", "env"]}
    text = lines(change_, bases(running, new))
    assert "~ worker@0, worker@1: command changed (restarted)" in text
    assert "~ plain@0: command, env changed (restarted)" in text
    gone = reread(tmp_path, running, BASE.split("[units.plain]")[0])
    removed = diff(running, gone)
    assert removed.removed == ["plain@0"] and removed.replicas == {"plain": (1, 0)}
    assert lines(removed, bases(running)) == ["- unit plain (plain@0)"]


def test_dependencies_and_probes_change_in_place(tmp_path: Path) -> None:
    text = BASE + """
    [units.front]
    command = ["f"]
    depends_on = { worker = "started" }
    ready = { kind = "tcp", port = 1, deadline = "{vars.workers}" }
    """
    running = load(tmp_path, text)
    new = reread(tmp_path, running, text, workers=3)
    change_ = diff(running, new)
    assert change_.changed == {"front": ["depends_on", "ready"]} and change_.restarted() == []
    assert "~ front: depends_on, ready changed (in place, no restart)" in lines(change_, {})
    edited = diff(running, reread(tmp_path, running, text.replace('["f"]', '["g"]')))
    assert edited.restarted() == ["front"]
    limited = text.replace('command = ["f"]', 'command = ["f"]\nlimits = { pids_max = 64 }')
    assert diff(running, reread(tmp_path, running, limited)).restarted() == ["front"]


def test_description_alone_is_no_change(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    new = reread(tmp_path, running, BASE.replace('command = ["p"]',
                                                 'command = ["p"]\ndescription = "x"'))
    assert diff(running, new).empty


def test_kept_and_given_vars(tmp_path: Path) -> None:
    running = load(tmp_path, BASE, workers=3)
    assert running.source.raw.overrides() == {"workers": 3}  # type: ignore[union-attr]
    assert diff(running, reread(tmp_path, running, BASE)).empty  # --var workers=3 kept
    smaller = diff(running, reread(tmp_path, running, BASE, workers=1))
    assert smaller.removed == ["worker@1", "worker@2"] and smaller.vars == {"workers": (3, 1)}


def test_a_typo_or_an_invalid_file_is_refused(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    with pytest.raises(SpecErrors, match="did you mean `workers`"):
        reread(tmp_path, running, BASE, wrokers=3)
    with pytest.raises(SpecErrors, match=r"field 'ports\.system'"):
        reread(tmp_path, running, BASE.replace("system = 0", "system = -1"))
    with pytest.raises(SpecErrors, match="running stack is 'stack'"):
        reread(tmp_path, running, '[stack]\nname = "other"\n' + BASE)
    from dynamod.core import live

    request = live.Request(path=str(write(tmp_path, BASE)), vars={"stack_id": "two"})
    with pytest.raises(SpecErrors, match="changes the stack's identity \\('stack' -> 'two'\\)"):
        live.next_stack(running, request, ports())


def test_policy_table_fields(tmp_path: Path) -> None:
    policy = BASE + """
    [units.worker.dynamo]
    etcd = "http://127.0.0.1:{units.etcd.ports.client}"
    namespace = "ns"
    system_url = "http://127.0.0.1:{ports.system}"
    [policy]
    store = "file"
    shards = ["worker"]
    min_ready_shards = 1
    """
    running = load(tmp_path, policy)
    new = reread(tmp_path, running, policy.replace("min_ready_shards = 1", "min_ready_shards = 2"))
    change_ = diff(running, new)
    assert change_.tables == {"policy": {"min_ready_shards": (1, 2)}} and not change_.changed
    assert lines(change_, {}) == ["~ [policy] min_ready_shards: 1 -> 2"]
    assert StackDiff.from_json(change_.as_json()) == change_


def test_scale_sets_the_variable_or_the_replicas(tmp_path: Path) -> None:
    running = load(tmp_path, BASE)
    three = change.scaled(running, "worker", 3, allocate_port=ports())
    assert diff(running, three).added == ["worker@2"]
    assert three.source.raw.vars["workers"] == 3  # type: ignore[union-attr]
    plain = change.scaled(running, "plain", 2, allocate_port=ports())
    assert diff(running, plain).added == ["plain@1"] and diff(running, plain).vars == {}
    with pytest.raises(SpecErrors, match="unit 'etcd', field 'replicas': is not a replicated"):
        change.scaled(running, "etcd", 2, allocate_port=ports())
    with pytest.raises(UnknownUnit, match="did you mean worker"):
        change.scaled(running, "wroker", 2, allocate_port=ports())
    assert running.source.raw.units["plain"].table["replicas"] == 1  # type: ignore[union-attr]


@settings(max_examples=30, deadline=None)
@given(before=st.integers(0, 6), after=st.integers(0, 6))
def test_scaling_adds_and_removes_exactly_the_top_replicas(before: int, after: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        running = load(Path(tmp), BASE, workers=before)
        new = change.scaled(running, "worker", after, allocate_port=ports())
        result = diff(running, new)
    low, high = sorted((before, after))
    moved = [f"worker@{i}" for i in range(low, high)]
    assert (result.added, result.removed) == ((moved, []) if after > before else ([], moved))
    assert result.changed == {}
    assert result.replicas == ({"worker": (before, after)} if before != after else {})
    assert result.empty == (before == after)


def test_a_push_is_refused_while_an_apply_changes_the_stack(tmp_path: Path) -> None:
    from dynamod.core.daemon import Daemon, StateDir
    from dynamod.core.errors import DynamodError
    from dynamod.core.phase import Phase

    daemon = Daemon(stack=load(tmp_path, BASE), state=StateDir(tmp_path / "s"))
    (tmp_path / "s").mkdir()
    daemon.phase = Phase.UP
    daemon.require_running("a policy update")  # nothing in the way
    daemon.applying = "apply of stack.toml"
    with pytest.raises(DynamodError, match=r"an apply is changing the stack \(apply of stack"):
        daemon.require_running("a policy update")


@pytest.mark.parametrize(("body", "problem"), [
    ([], "a JSON object"),
    ({"path": "a.toml", "scale": ["w", 2]}, "either"),
    ({}, "either"),
    ({"scale": ["w", True]}, '"scale"'),
    ({"path": 3}, '"path"'),
    ({"path": "a.toml", "vars": {"w": [1]}}, '"vars"'),
    ({"path": "a.toml", "timeout": 0}, '"timeout"'),
])
def test_apply_requests_of_the_wrong_shape_are_refused(body: object, problem: str) -> None:
    from dynamod.core import live
    from dynamod.core.errors import DynamodError

    with pytest.raises(DynamodError, match=problem):
        live.Request.from_json(body)
    assert live.Request.from_json({"scale": ["w", 2], "dry_run": True}).scale == ("w", 2)


@pytest.mark.parametrize("target", ["worker=abc", "worker", "=3", "worker=999999"])
def test_scale_of_a_malformed_target_is_one_line_and_exit_2(target: str) -> None:
    from tests import cli_inprocess

    result = cli_inprocess.run(["--state-dir", "/nonexistent/dynamod", "scale", target])
    assert result.code == 2 and result.stderr.count("\n") == 1
    assert "expects a replicated unit's name" in result.stderr
