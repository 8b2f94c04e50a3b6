"""The simulated cluster's stack file (no cluster is started here): the sandbox's nodes put
on the `nodes = {...}` line of the stock stack, or of the stack file it is based on, which
is written beside it; every file it names stays where the stock one is."""

from __future__ import annotations

import itertools
from pathlib import Path

from dynamod.chaos.cluster import _rewritten
from dynamod.core import paths, spec

NODES = 'nodes = { head = "10.9.0.1", n1 = "10.9.0.2" }'


def _load(path: Path) -> spec.Stack:
    counter = itertools.count(42000)
    return spec.load(path, state_dir=Path("/tmp/x"), allocate_port=lambda: next(counter),
                     node="n1")  # fmt: skip


def test_a_stack_on_a_base_gets_the_nodes_through_its_base(tmp_path: Path) -> None:
    stacks = paths.units_dir() / "stacks"
    texts = _rewritten(stacks / "cluster-verl.toml", NODES, tmp_path / "cluster.toml")
    assert len(texts) == 2 and NODES in texts[1] and NODES not in texts[0]
    assert f'base = "{tmp_path}/base-cluster.toml"' in texts[0]
    stack = _load(tmp_path / "cluster.toml")
    assert stack.name == "cluster-verl"
    assert stack.cluster is not None and stack.cluster.nodes == {"head": "10.9.0.1",
                                                                 "n1": "10.9.0.2"}
    assert {"ray-worker", "worker@0"} <= set(stack.units)  # the Ray worker runs on n1


def test_a_stack_without_a_base_is_rewritten_alone(tmp_path: Path) -> None:
    texts = _rewritten(paths.units_dir() / "stacks" / "cluster.toml", NODES,
                       tmp_path / "cluster.toml")  # fmt: skip
    assert len(texts) == 1 and NODES in texts[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.toml"]
    assert _load(tmp_path / "cluster.toml").name == "cluster"
