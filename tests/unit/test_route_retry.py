"""The route canary's back-off (rollout/policy.py `route_retry`): fast for the first
seconds, where a new taint reaches the frontend, then slower, so that many held shards
do not flood a frontend that cannot route them."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from dynamod.rollout import policy


def _gaps(waited_at: list[float]) -> list[float]:
    gaps: list[float] = []
    gap: float | None = None
    for waited in waited_at:
        gap = policy.route_retry(gap, waited)
        gaps.append(gap)
    return gaps


def test_the_first_seconds_retry_fast_then_the_gap_grows_to_a_second() -> None:
    fast = _gaps([0.0] * 8)
    assert fast[0] == 0.01 and fast[1] == 0.02 and max(fast) == 0.1
    slow = _gaps([0.0] * 8 + [3.0] * 8)
    assert slow[8] == 0.2 and slow[-1] == 1.0, slow


def test_canaries_per_second_from_32_held_shards_after_a_minute() -> None:
    """The load the fleet benchmark saw: ~300/s at the old 0.1 s cap; now 32/s at most."""
    waited, gap, sent = 0.0, None, 0
    while waited < 60.0:
        gap = policy.route_retry(gap, waited)
        waited += gap
        sent += 1
    assert policy.route_retry(gap, waited) == 1.0  # 32 held shards: 32 canaries/s, not 320
    assert sent < 100, f"one shard sent {sent} canaries in a minute (600 at a 0.1 s cap)"


@given(st.lists(st.floats(min_value=0, max_value=600), min_size=1, max_size=40))
def test_a_gap_never_shrinks_and_stays_within_the_caps(waits: list[float]) -> None:
    gaps = _gaps(sorted(waits))
    assert all(0.01 <= g <= 1.0 for g in gaps)
    assert all(b >= a for a, b in itertools.pairwise(gaps))
