"""The pause between readiness attempts (pure): a start is probed at its unit's own interval
for 2 s, then less often as it keeps waiting (5 % of the wait, up to 0.5 s), so a daemon
starting 32 slow shards does not spend its CPU on 640 connection attempts a second."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamod.core.probes import READY_FAST_S, READY_SLOW_MAX_S, ready_pause

INTERVALS = st.floats(min_value=0.01, max_value=30, allow_nan=False)
WAITS = st.floats(min_value=0, max_value=86_400, allow_nan=False)


def test_a_start_is_probed_at_its_interval_first_then_less_often() -> None:
    assert ready_pause(0.05, 0.0) == ready_pause(0.05, 1.99) == 0.05
    assert ready_pause(0.05, 4.0) == 0.2  # 5 % of the wait
    assert ready_pause(0.05, 10.0) == 0.5  # seen ready at most 0.5 s late
    assert ready_pause(0.05, 600.0) == READY_SLOW_MAX_S
    assert ready_pause(2.0, 600.0) == 2.0  # a unit that asks for a slower probe gets it


@given(INTERVALS, WAITS, WAITS)
def test_the_pause_never_undercuts_the_interval_and_only_grows(
    interval: float, a: float, b: float
) -> None:
    early, late = sorted((a, b))
    assert interval <= ready_pause(interval, early) <= ready_pause(interval, late)
    assert ready_pause(interval, late) <= max(interval, READY_SLOW_MAX_S)
    if late < READY_FAST_S:
        assert ready_pause(interval, late) == interval
