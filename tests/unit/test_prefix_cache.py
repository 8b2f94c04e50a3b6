"""The numpy engine's prefix cache: chained block hashes, lookups, events, eviction."""

from __future__ import annotations

from typing import Any

from dynamod.workers.cpu.prefix_cache import PrefixCache, block_hashes


def cache(capacity: int = 8) -> tuple[PrefixCache, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    return PrefixCache(4, capacity, events.append), events


def test_hashes_are_chained_and_cover_full_blocks_only() -> None:
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != a[1]  # same block, other parent
    assert block_hashes(list(range(8)), 4) == a
    assert all(0 <= h < 2**63 for h in a)


def test_a_repeat_finds_the_prefix_but_leaves_the_last_token_to_compute() -> None:
    prefix, events = cache()
    tokens = list(range(8))
    assert prefix.lookup(tokens) == []
    prefix.store(tokens, lambda i: f"kv{i}")
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": block_hashes(tokens, 4),
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
        }
    ]
    assert prefix.lookup(tokens) == ["kv0"]  # block 1 holds the last token
    assert prefix.lookup([*tokens, 99]) == ["kv0", "kv1"]
    assert prefix.stats.hit_tokens == 4 + 8
    assert prefix.stats.queried_tokens == 8 + 8 + 9


def test_only_new_blocks_are_stored_and_announced_with_their_parent() -> None:
    prefix, events = cache()
    prefix.store(list(range(4)), lambda i: i)
    prefix.store(list(range(12)), lambda i: i)
    hashes = block_hashes(list(range(12)), 4)
    assert events[1]["block_hashes"] == hashes[1:]
    assert events[1]["parent_block_hash"] == hashes[0]
    assert events[1]["token_ids"] == list(range(4, 12))
    prefix.store(list(range(12)), lambda i: i)
    assert len(events) == 2 and len(prefix) == 3


def test_least_recently_used_blocks_are_evicted_and_reported_removed() -> None:
    prefix, events = cache(capacity=2)
    first, second = [1, 1, 1, 1], [2, 2, 2, 2]
    prefix.store(first, lambda i: "first")
    prefix.store(second, lambda i: "second")
    prefix.lookup([*first, 0])  # first is now the most recent
    prefix.store([3, 3, 3, 3], lambda i: "third")
    assert events[-1] == {
        "type": "BlockRemoved",
        "block_hashes": block_hashes(second, 4),
        "medium": "GPU",
    }
    assert prefix.lookup([*first, 0]) == ["first"]
    assert prefix.lookup([*second, 0]) == []
    assert prefix.stats.evicted_blocks == 1


def test_clear_empties_the_cache_and_says_so() -> None:
    prefix, events = cache()
    prefix.store(list(range(8)), lambda i: i)
    prefix.clear()
    assert len(prefix) == 0 and events[-1] == {"type": "AllBlocksCleared"}
    assert prefix.lookup([*range(8), 0]) == []
