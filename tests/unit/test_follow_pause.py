"""How often `up` asks the daemon for its status while it waits (pure): every 0.05 s at
first, then 2 % of the wait so far, at most every 0.5 s; so a long start costs the daemon
~2 answers a second, not 20, and a start is reported at most 2 % of its length late."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamod.control.launch import FOLLOW_MAX_S, FOLLOW_MIN_S, follow_pause

WAITS = st.floats(min_value=0, max_value=86_400, allow_nan=False)


def test_up_asks_often_at_first_then_less() -> None:
    assert follow_pause(0.0) == follow_pause(2.5) == 0.05
    assert follow_pause(10.0) == 0.2
    assert follow_pause(60.0) == follow_pause(3600.0) == 0.5


@given(WAITS, WAITS)
def test_the_pause_only_grows_within_its_bounds_and_stays_a_small_share(a: float, b: float) -> None:
    early, late = sorted((a, b))
    assert FOLLOW_MIN_S <= follow_pause(early) <= follow_pause(late) <= FOLLOW_MAX_S
    assert follow_pause(late) <= max(FOLLOW_MIN_S, 0.02 * late + 1e-9)
