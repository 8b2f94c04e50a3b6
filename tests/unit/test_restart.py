import random

from dynamod.core.restart import Exit, RestartTracker
from dynamod.core.spec import RestartSpec

CRASH = Exit(code=1, signal=None)
KILLED = Exit(code=None, signal=9)
CLEAN = Exit(code=0, signal=None)


def tracker(**kw: object) -> RestartTracker:
    spec = RestartSpec.model_validate({"jitter": 0, **kw})
    return RestartTracker(spec, rng=random.Random(1))


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    t = tracker(backoff_initial=0.1, backoff_factor=2, backoff_max=0.5, limit_burst=100)
    delays = [t.decide(CRASH, now=i, uptime=0.1, premature=False).delay for i in range(7)]
    assert delays == [0.0, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5]  # the first restart is immediate


def test_a_unit_that_never_stays_up_keeps_the_capped_delay_past_a_thousand_restarts() -> None:
    """The attempt count has no bound while the unit never stays up reset_after; the
    backoff once overflowed a float (2.0 ** 1024) and the exit went unrecorded."""
    t = tracker(backoff_initial=0.05, backoff_factor=2, backoff_max=0.05, limit_burst=10000)
    delays = [t.decide(KILLED, now=i, uptime=0.1, premature=True).delay for i in range(1500)]
    assert delays[0] == 0.0 and set(delays[1:]) == {0.05}
    assert t.total == 1500


def test_an_exit_names_its_signal() -> None:
    assert KILLED.describe() == "killed by SIGKILL"
    assert Exit(code=None, signal=6).describe() == "killed by SIGABRT"
    assert Exit(code=None, signal=200).describe() == "killed by 200"
    assert CRASH.describe() == "exited with status 1"


def test_first_delay_is_configurable() -> None:
    t = tracker(first_delay=0.3, backoff_initial=1, limit_burst=100)
    delays = [t.decide(CRASH, now=i, uptime=0.1, premature=False).delay for i in range(3)]
    assert delays == [0.3, 1, 2]


def test_jitter_stays_within_the_fraction() -> None:
    spec = RestartSpec(first_delay=1.0, backoff_initial=1.0, backoff_factor=1, jitter=0.2,
                       limit_burst=1000)
    t = RestartTracker(spec, rng=random.Random(7))
    delays = [t.decide(CRASH, now=i * 100, uptime=0, premature=False).delay for i in range(200)]
    assert min(delays) >= 0.8 and max(delays) <= 1.2
    assert len(set(delays)) > 100  # actually jittered


def test_restart_limit_counts_a_burst_within_the_interval() -> None:
    t = tracker(limit_burst=3, limit_interval=10)
    decisions = [t.decide(CRASH, now=float(i), uptime=0.1, premature=False) for i in range(4)]
    assert [d.restart for d in decisions] == [True, True, True, False]
    assert "restart limit reached: 3 restarts within 10s" in decisions[-1].reason
    assert decisions[0].reason == "restarting in 0.00s"


def test_restarts_outside_the_window_do_not_count() -> None:
    t = tracker(limit_burst=2, limit_interval=10)
    assert t.decide(CRASH, now=0, uptime=1, premature=False).restart
    assert t.decide(CRASH, now=1, uptime=1, premature=False).restart
    assert not t.decide(CRASH, now=2, uptime=1, premature=False).restart
    assert t.decide(CRASH, now=20, uptime=1, premature=False).restart


def test_long_uptime_resets_the_backoff() -> None:
    t = tracker(backoff_initial=1, backoff_factor=2, reset_after=30, limit_burst=100)
    assert t.decide(CRASH, now=0, uptime=1, premature=False).delay == 0
    assert t.decide(CRASH, now=10, uptime=1, premature=False).delay == 1
    assert t.decide(CRASH, now=20, uptime=1, premature=False).delay == 2
    assert t.decide(CRASH, now=100, uptime=60, premature=False).delay == 0


def test_policies() -> None:
    assert not tracker(policy="never").decide(CRASH, now=0, uptime=0, premature=False).restart
    on_failure = tracker(policy="on-failure")
    assert on_failure.decide(KILLED, now=0, uptime=0, premature=False).restart
    assert not on_failure.decide(CLEAN, now=1, uptime=0, premature=False).restart
    # a service that exits 0 before it was ready still failed
    assert on_failure.decide(CLEAN, now=2, uptime=0, premature=True).restart
    assert tracker(policy="always").decide(CLEAN, now=0, uptime=0, premature=False).restart


def test_past_the_limit_a_unit_that_never_gives_up_retries_every_backoff_max() -> None:
    t = tracker(limit_burst=2, limit_interval=100, backoff_max=7, give_up=False)
    decisions = [t.decide(CRASH, now=float(i), uptime=0.1, premature=False) for i in range(4)]
    assert [d.restart for d in decisions] == [True, True, True, True]
    assert [d.delay for d in decisions[2:]] == [7, 7]
    assert "restart limit reached" in decisions[2].reason
    assert "retrying in 7.00s" in decisions[2].reason
    assert t.total == 4
    # the default still gives up
    default = tracker(limit_burst=1)
    assert default.decide(CRASH, now=0, uptime=0, premature=False).restart
    assert not default.decide(CRASH, now=1, uptime=0, premature=False).restart


def test_manual_reset_forgets_the_burst() -> None:
    t = tracker(limit_burst=1)
    assert t.decide(CRASH, now=0, uptime=0, premature=False).restart
    assert not t.decide(CRASH, now=1, uptime=0, premature=False).restart
    t.reset()
    assert t.decide(CRASH, now=2, uptime=0, premature=False).restart
    assert t.total == 2


def test_exit_descriptions() -> None:
    assert KILLED.describe() == "killed by SIGKILL"
    assert CRASH.describe() == "exited with status 1"
