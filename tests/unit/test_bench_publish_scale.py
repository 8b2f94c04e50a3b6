"""bench.publish_scale's one piece of pure logic: the shard counts it accepts."""

from __future__ import annotations

import pytest

from bench.publish_scale import shard_counts


def test_rising_counts_from_one_are_taken() -> None:
    assert shard_counts("1,8,32") == [1, 8, 32]
    assert shard_counts(" 1, 2 ,") == [1, 2]


@pytest.mark.parametrize("text", ["", "8,32", "1,1,8", "1,32,8", "1,x", "0,1"])
def test_anything_else_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match=r"--shards .*rising counts starting at 1"):
        shard_counts(text)
