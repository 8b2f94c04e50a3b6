"""Where a trainer rank sits on its node (dynamod/integrations/verl/ranks.py): its share of
its own node's shards, as a colocated sender and as a replica's leader waking them."""

from __future__ import annotations

import pytest

from dynamod.integrations.verl.ranks import local_world_size, node_replica


def test_on_one_node_a_replica_is_its_global_rank_s() -> None:
    # 4 ranks, tensor parallel 2: replicas 0 and 1, as rank // replica_world gave before
    assert [node_replica(r, 2, 4, 0) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [node_replica(r, 2, 4, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_on_two_nodes_each_node_s_replicas_are_counted_among_its_own() -> None:
    # 2 nodes x 4 GPUs, tensor parallel 2: ranks 4-7 are n1's replicas 0 and 1 of 2, not
    # replicas 2 and 3 of 4 of a list that holds only n1's shards
    assert [node_replica(r, 2, 8, 4) for r in range(4, 8)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # one rank a shard: rank 5 is n1's second sender
    assert node_replica(5, 1, 8, 4) == (1, 4)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, 0),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"RAY_LOCAL_WORLD_SIZE": "8"}, 8),
    ({"LOCAL_WORLD_SIZE": "2", "RAY_LOCAL_WORLD_SIZE": "8"}, 2),  # torchrun's first
    ({"LOCAL_WORLD_SIZE": "0", "RAY_LOCAL_WORLD_SIZE": "x"}, 0),  # neither says
])  # fmt: skip
def test_the_ranks_on_a_node_come_from_the_launcher_s_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: int
) -> None:
    for name in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert local_world_size() == expected
