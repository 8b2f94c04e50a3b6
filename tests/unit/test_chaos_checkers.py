"""Every checker fed histories that must pass and histories that must fail (a checker
that cannot fail is a defect)."""

from __future__ import annotations

from typing import Any

import pytest

from dynamod.chaos import checkers
from dynamod.chaos.history import (
    CacheSample,
    Fault,
    History,
    PortTake,
    Request,
    StateChange,
    Teardown,
    UnitSeen,
    VersionSample,
)
from dynamod.chaos.model import Invariant


def inv(check: str, **kw: Any) -> Invariant:
    return Invariant.model_validate({"check": check, **kw})


def versions(*changes: tuple[float, int]) -> list[VersionSample]:
    return [VersionSample(t, v, {"worker@0": v}, {"worker@0": True}) for t, v in changes]


def ok(sent: float, version: int, required: int | None = None) -> Request:
    return Request(sent, sent + 0.05, 200, required=required, version=version, instance="a")


def status(current: int, shards: dict[str, tuple[int | None, bool]]) -> dict[str, Any]:
    return {"policy": {"current": current}, "units": [
        {"name": n, "policy_version": v, "policy": {"admitted": a}}
        for n, (v, a) in shards.items()] + [{"name": "etcd"}]}


# ---------------------------------------------------------------- shards_current

def test_shards_current_passes_when_every_admitted_shard_is_current() -> None:
    h = History(final_status=status(3, {"worker@0": (3, True), "worker@1": (None, False)}))
    v = checkers.shards_current(h, inv("shards_current"))
    assert v.ok and "not admitted: worker@1" in v.detail


def test_shards_current_believes_the_shard_over_dynamods_status() -> None:
    final = status(3, {"worker@0": (3, True)})
    final["units"][0]["engine"] = {"status": "ok", "version": 0}
    v = checkers.shards_current(History(final_status=final), inv("shards_current"))
    assert not v.ok and "the shard says" in v.detail
    final["units"][0]["engine"] = {"status": "ok", "version": 3}
    assert checkers.shards_current(History(final_status=final), inv("shards_current")).ok


@pytest.mark.parametrize("final", [
    status(3, {"worker@0": (3, True), "worker@1": (2, True)}),   # one admitted but stale
    status(3, {"worker@0": (None, False)}),                       # nothing admitted
    None,                                                         # nothing recorded
])
def test_shards_current_fails(final: dict[str, Any] | None) -> None:
    assert not checkers.shards_current(History(final_status=final), inv("shards_current")).ok


# ---------------------------------------------------------------- no_stale_serving

def test_no_stale_serving_passes_with_old_versions_only_before_the_boundary() -> None:
    h = History(versions=versions((0, 0), (10, 1)),
                requests=[ok(5, 0), ok(9.9, 0), ok(10.2, 0, required=0), ok(11, 1, required=1),
                          ok(10.3, 1)])
    assert checkers.no_stale_serving(h, inv("no_stale_serving", grace=0.5)).ok


@pytest.mark.parametrize("request_", [
    ok(12, 0),                 # served at 0 after the boundary at 10 (+ grace) has passed
    ok(5, 0, required=1),      # served below the version it required
    Request(12, 12.1, 200),    # no weight version stamped: cannot be judged
])
def test_no_stale_serving_fails(request_: Request) -> None:
    h = History(versions=versions((0, 0), (10, 1)), requests=[ok(11, 1), request_])
    v = checkers.no_stale_serving(h, inv("no_stale_serving", grace=0.5))
    assert not v.ok, v.detail


def test_no_stale_serving_counts_unstamped_trainer_completions_apart() -> None:
    h = History(versions=versions((0, 0), (10, 1)),
                requests=[ok(11, 1), Request(12, 12.1, 200), Request(13, 13.1, 200, required=1)])
    v = checkers.no_stale_serving(h, inv("no_stale_serving"))
    assert not v.ok and v.measured["unstamped"] == 2 and v.measured["unstamped_trainer"] == 1


def test_no_stale_serving_fails_with_nothing_served() -> None:
    h = History(versions=versions((0, 0)), requests=[Request(1, 2, 500)])
    assert not checkers.no_stale_serving(h, inv("no_stale_serving")).ok


# ---------------------------------------------------------------- client_errors

def test_client_errors_within_bound_pass_and_above_fail() -> None:
    reqs = [ok(i, 0) for i in range(98)] + [Request(1, 2, 503), Request(2, 3, -1)]
    assert checkers.client_errors(History(requests=reqs),
                                  inv("client_errors", max_error_rate=0.02)).ok
    v = checkers.client_errors(History(requests=reqs), inv("client_errors", max_errors=1))
    assert not v.ok and v.measured["by_status"] == {"503": 1, "-1": 1}
    assert not checkers.client_errors(History(requests=reqs),
                                      inv("client_errors", max_error_rate=0.01)).ok
    assert not checkers.client_errors(History(), inv("client_errors")).ok


def test_client_errors_counts_only_the_traffic_named() -> None:
    reqs = [ok(i, 0) for i in range(10)] + [Request(1, 2, 500, required=0)]
    h = History(requests=reqs)
    assert checkers.client_errors(h, inv("client_errors", traffic="plain", max_errors=0)).ok
    trainer = checkers.client_errors(h, inv("client_errors", traffic="trainer", max_errors=0))
    assert not trainer.ok and trainer.measured["requests"] == 1


# ---------------------------------------------------------------- recovery_time

def unit_down_and_up(down: float, up: float) -> list[StateChange]:
    return [StateChange(down, "worker@1", "ready", "backoff"),
            StateChange(down + 0.1, "worker@1", "backoff", "starting"),
            StateChange(up - 0.5, "worker@1", "starting", "held"),
            StateChange(up, "worker@1", "held", "ready")]


def test_recovery_time_measures_fault_to_ready_again() -> None:
    h = History(faults=[Fault(10, "SIGKILL worker@1", "worker@1")],
                states=unit_down_and_up(10.01, 16), requests=[ok(10.5, 0)])
    v = checkers.recovery_time(h, inv("recovery_time", max_seconds=10))
    assert v.ok and v.measured["faults"][0]["unit_s"] == 6.0


def test_recovery_time_counts_a_trainer_that_ran_again_to_completion() -> None:
    # the resumed trainer pushed its last steps and exited 0 before min_uptime made it ready
    states = [StateChange(10.01, "trainer", "ready", "backoff"),
              StateChange(10.2, "trainer", "backoff", "starting"),
              StateChange(10.9, "trainer", "starting", "completed")]
    h = History(faults=[Fault(10, "SIGKILL trainer", "trainer")], states=states,
                requests=[ok(10.5, 0)])
    v = checkers.recovery_time(h, inv("recovery_time", max_seconds=10))
    assert v.ok and v.measured["faults"][0]["unit_s"] == 0.9


@pytest.mark.parametrize("history", [
    # too slow
    History(faults=[Fault(10, "kill", "worker@1")], states=unit_down_and_up(10, 25),
            requests=[ok(11, 0)]),
    # never ready again
    History(faults=[Fault(10, "kill", "worker@1")],
            states=[StateChange(10, "worker@1", "ready", "failed")], requests=[ok(11, 0)]),
    # the trainer was killed and gave up: failed is not completed
    History(faults=[Fault(10, "kill", "trainer")],
            states=[StateChange(10, "trainer", "ready", "backoff"),
                    StateChange(11, "trainer", "backoff", "starting"),
                    StateChange(12, "trainer", "starting", "failed")], requests=[ok(11, 0)]),
    # nothing served after the heal of a fault without a unit
    History(faults=[Fault(10, "proxy down", None, healed_at=20)], requests=[ok(5, 0)]),
    # no fault at all: nothing was recovered
    History(requests=[ok(5, 0)]),
])
def test_recovery_time_fails(history: History) -> None:
    assert not checkers.recovery_time(history, inv("recovery_time", max_seconds=10)).ok


# ---------------------------------------------------------------- no_leftovers

def test_no_leftovers() -> None:
    assert checkers.no_leftovers(History(teardown=Teardown()), inv("no_leftovers")).ok
    for td in (Teardown(alive_pids=[123]), Teardown(bound_ports=[2379]),
               Teardown(stale_registrations=["v1/instances/ns/backend/generate/1f"]),
               Teardown(down_ok=False, down_output="left 1 process")):
        assert not checkers.no_leftovers(History(teardown=td), inv("no_leftovers")).ok
    assert not checkers.no_leftovers(History(), inv("no_leftovers")).ok


# ---------------------------------------------------------------- trainer_progress

def test_trainer_progress() -> None:
    moved = History(versions=versions((0, 2), (5, 3), (9, 4)), start_version=2)
    assert checkers.trainer_progress(moved, inv("trainer_progress", min_versions=2)).ok
    assert not checkers.trainer_progress(moved, inv("trainer_progress", min_versions=3)).ok
    stuck = History(versions=versions((0, 2), (9, 2)), start_version=2)
    assert not checkers.trainer_progress(stuck, inv("trainer_progress")).ok
    assert not checkers.trainer_progress(History(), inv("trainer_progress")).ok


# ---------------------------------------------------------------- cache_hit_recovers

def cache(*rows: tuple[float, float]) -> list[CacheSample]:
    return [CacheSample(t, "worker@0", r) for t, r in rows]


def test_cache_hit_recovers_after_warmup() -> None:
    h = History(versions=versions((0, 0), (10, 1)),
                cache=cache((5, 0.8), (8, 0.7), (11, 0.0), (16, 0.6), (18, 0.7)))
    v = checkers.cache_hit_recovers(h, inv("cache_hit_recovers", warmup=5, min_fraction=0.5))
    assert v.ok, v.detail


@pytest.mark.parametrize("history", [
    History(versions=versions((0, 0), (10, 1)), cache=cache((5, 0.8), (16, 0.1))),  # no recovery
    History(versions=versions((0, 0), (10, 1)), cache=cache((5, 0.0), (16, 0.0))),  # never hit
    History(versions=versions((0, 0), (10, 1)), cache=cache((5, 0.8))),             # no samples
    History(versions=versions((0, 0)), cache=cache((5, 0.8))),                      # no update
    History(versions=versions((0, 0), (10, 1))),                                    # no data
])
def test_cache_hit_recovers_fails(history: History) -> None:
    assert not checkers.cache_hit_recovers(history, inv("cache_hit_recovers", warmup=5)).ok


def test_every_invariant_kind_has_a_checker() -> None:
    from typing import get_args

    kinds = set(get_args(Invariant.model_fields["check"].annotation))
    assert kinds == set(checkers.CHECKERS)


def test_hit_rate_is_read_from_the_workers_prefix_counters() -> None:
    from dynamod.chaos.observer import parse_prefix_counters
    from dynamod.workers.cpu.routes import prefix_cache_metrics

    served = prefix_cache_metrics(
        {"engine": "torch", "prefix_cache": {"queried_tokens": 40, "hit_tokens": 30}}, "tiny")
    assert parse_prefix_counters(served) == (30.0, 40.0)
    # two series (dynamo.vllm labels per engine) are summed; the router's histogram is not read
    two = served + served.replace('engine="torch"', 'engine="other"')
    assert parse_prefix_counters(two) == (60.0, 80.0)
    router = ("dynamo_component_router_kv_hit_rate_sum 1.5\n"
              "dynamo_component_router_kv_hit_rate_count 4\n")
    assert parse_prefix_counters(router) is None
    # an engine without a prefix cache (the mocker) shows no counters: nothing is sampled
    assert prefix_cache_metrics({"engine": "mocker"}, "tiny") == ""
    assert parse_prefix_counters("") is None


def test_up_fails_naming() -> None:
    check = inv("up_fails_naming", names=["frontend", "straggler"])
    named = History(up_returncode=1, up_output="frontend not ready: straggler never registered")
    assert checkers.up_fails_naming(named, check).ok
    for h in (History(up_returncode=1, up_output="frontend not ready: 1/2 instances"),
              History(up_returncode=0, up_output="frontend straggler"), History()):
        assert not checkers.up_fails_naming(h, check).ok


def aligned(sent: float, n: int, logprobs: int | None = None) -> Request:
    return Request(sent, sent + 0.1, 200, version=0, finish="length", token_ids=n,
                   logprobs=n if logprobs is None else logprobs, usage_tokens=n)


def test_token_alignment() -> None:
    good = History(requests=[aligned(1, 4), aligned(2, 3), Request(3, 4, 500)])
    v = checkers.token_alignment(good, inv("token_alignment"))
    assert v.ok and v.measured["terminal"] == 2 and v.measured["cancelled_or_failed"] == 1
    for bad in (aligned(1, 4, logprobs=3),
                Request(1, 2, 200, version=0, finish="stop", token_ids=4, usage_tokens=4)):
        assert not checkers.token_alignment(History(requests=[aligned(0, 2), bad]),
                                            inv("token_alignment")).ok
    assert not checkers.token_alignment(History(requests=[Request(1, 2, 500)]),
                                        inv("token_alignment")).ok


# ---------------------------------------------------------------- port_conflict_truthful

def taken(*seen: tuple[float, str, str, int]) -> PortTake:
    """frontend's http=24000 taken at t=10 by pid 4242; seen: (at, state, detail, port)."""
    return PortTake(10.0, "frontend", "http", 24000, 4242, "python", released_at=30.0,
                    seen=[UnitSeen(at, state, detail, {"http": port})
                          for at, state, detail, port in seen])


REFUSED = "exited 1: port http=24000 is taken by pid 4242 (python); not restarted"


@pytest.mark.parametrize("take, requests, expect", [
    # an error naming the port and its owner's pid, within the bound
    (taken((10.2, "backoff", "exited 1: address in use", 24000),
           (14.0, "failed", REFUSED, 24000)), [], "named http=24000 and its owner after 4.0s"),
    # the unit spawned on another port and served there
    (taken((10.2, "starting", "", 25111), (13.0, "ready", "ok", 25111)),
     [ok(13.5, 0)], "moved to 25111, serving after 3.0s"),
])
def test_port_conflict_truthful_passes(take: PortTake, requests: list[Request],
                                       expect: str) -> None:
    v = checkers.port_conflict_truthful(History(requests=requests, port_takes=[take]),
                                        inv("port_conflict_truthful", max_seconds=15))
    assert v.ok and expect in v.detail, v


@pytest.mark.parametrize("history, expect", [
    (History(), "no port was taken"),
    # retrying for ever with an error that names neither the port's owner nor a new port
    (History(port_takes=[taken(*[(10.0 + i, "backoff", "exited 1; restarting in 5s", 24000)
                                 for i in range(20)])]), "neither an error naming"),
    # the owner named only after the bound
    (History(port_takes=[taken((10.2, "starting", "", 24000), (29.0, "failed", REFUSED, 24000))]),
     "neither an error naming"),
    # the pid's digits inside another number do not name the owner
    (History(port_takes=[taken((11.0, "failed", "port 24000 held by pid 142420", 24000))]),
     "neither an error naming"),
    # ready on another port, but nothing served after it (the load saw errors only)
    (History(requests=[Request(13.5, 14.0, 502)],
             port_takes=[taken((13.0, "ready", "ok", 25111))]), "neither an error naming"),
    # ready again on the port the chaos runner holds: a lie
    (History(port_takes=[taken((10.2, "backoff", "", 24000), (12.0, "ready", "ok", 24000))]),
     "reported ready on http=24000"),
])
def test_port_conflict_truthful_fails(history: History, expect: str) -> None:
    v = checkers.port_conflict_truthful(history, inv("port_conflict_truthful", max_seconds=15))
    assert not v.ok and expect in v.detail, v


# ---------------------------------------------------------------- none_paused

def _shards(**engine: dict[str, Any] | None) -> dict[str, Any]:
    """A final status whose admitted shards' engines answered `engine` (None: no answer)."""
    final = status(2, {name.replace("_", "@"): (2, True) for name in engine})
    for unit in final["units"]:
        answer = engine.get(unit["name"].replace("@", "_"))
        if answer is not None:
            unit["engine"] = answer
    return final


def test_none_paused_passes_when_every_engine_says_it_is_not() -> None:
    final = _shards(worker_0={"version": 2, "paused": False},
                    worker_1={"version": 2, "paused": False})  # fmt: skip
    v = checkers.none_paused(History(final_status=final), inv("none_paused"))
    assert v.ok and "2 admitted shards" in v.detail, v
    answered = _shards(worker_0={"version": 2, "paused": False, "paused_seen":
                                 "answered a pinned 1-token completion in 0.31s"})
    v = checkers.none_paused(History(final_status=answered), inv("none_paused"))
    assert v.ok and v.measured["seen"] == {"worker@0": answered["units"][0]["engine"][
        "paused_seen"]}, v


@pytest.mark.parametrize(("engine", "expect"), [
    # the orphaned pause dynamod never ended, while it calls the shard admitted
    ({"worker_0": {"version": 2, "paused": False}, "worker_1": {"version": 2, "paused": True}},
     "admitted shards paused: worker@1 (liveness)"),
    # dynamo.vllm's liveness does not say: a pinned completion it did not answer does
    ({"worker_0": {"version": 2, "paused": True,
                   "paused_seen": "no answer to a pinned 1-token completion within 30s"}},
     "paused: worker@0 (no answer to a pinned 1-token completion within 30s)"),
    # an engine that does not say, and was not asked: nothing to judge is not a pass
    ({"worker_0": {"version": 2}}, "nothing to judge"),
    ({"worker_0": None}, "nothing to judge"),
])
def test_none_paused_fails(engine: dict[str, Any], expect: str) -> None:
    v = checkers.none_paused(History(final_status=_shards(**engine)), inv("none_paused"))
    assert not v.ok and expect in v.detail, v
    assert not checkers.none_paused(History(), inv("none_paused")).ok


# ---------------------------------------------------------------- one broken run per checker

# For every checker, the history a deliberately broken run records (the cheap broken
# variant of issue 11: the checkers are pure, so the run need not be repeated on a stack).
BROKEN: dict[str, tuple[History, dict[str, Any]]] = {
    # admission without replay: a shard admitted at the old version, by its own word
    "shards_current": (History(final_status={**status(2, {"worker@0": (2, True)}), "units": [
        {"name": "worker@0", "policy_version": 2, "policy": {"admitted": True},
         "engine": {"version": 1}}]}), {}),
    "no_stale_serving": (History(versions=versions((0, 1), (10, 2)),
                                 requests=[ok(12, 1)]), {}),
    "client_errors": (History(requests=[ok(1, 0), Request(2, 3, 502)]), {"max_errors": 0}),
    # a hang detected only after liveness gave up 40 s later
    "recovery_time": (History(faults=[Fault(10, "SIGSTOP worker@1", "worker@1", 10.5)],
                              states=unit_down_and_up(11, 50), requests=[ok(51, 0)]),
                      {"max_seconds": 30}),
    "no_leftovers": (History(teardown=Teardown(alive_pids=[4242])), {}),
    "trainer_progress": (History(versions=versions((0, 0), (30, 0)), start_version=0), {}),
    "cache_hit_recovers": (History(versions=versions((0, 0), (10, 1)),
                                   cache=cache((5, 0.8), (20, 0.05))), {}),
    "up_fails_naming": (History(up_returncode=1, up_output="frontend: 1/2 instances"),
                        {"names": ["straggler"]}),
    "token_alignment": (History(requests=[aligned(1, 4, logprobs=0)]), {}),
    "port_conflict_truthful": (History(port_takes=[taken(
        (11.0, "backoff", "exited with status 1 (exited before it was ready)", 24000))]), {}),
    # a shard left paused by a pauser that died, shown admitted
    "none_paused": (History(final_status=_shards(worker_0={"version": 2, "paused": True})), {}),
}


def test_every_checker_has_a_broken_run_and_fails_it() -> None:
    assert set(BROKEN) == set(checkers.CHECKERS)
    for check, (history, bounds) in BROKEN.items():
        verdict = checkers.CHECKERS[check](history, inv(check, **bounds))
        assert not verdict.ok, f"{check} must fail its broken run: {verdict}"
