"""Pure parts of the verl rollout backend: settings, stack view, completions, versions."""

from __future__ import annotations

from typing import Any

import pytest

from dynamod.integrations.verl.completions import Completion, build_request, parse_response
from dynamod.integrations.verl.config import RolloutSettings, parse_settings
from dynamod.integrations.verl.errors import (
    GenerationError,
    RolloutConfigError,
    StackNotReadyError,
    UnsupportedVerlError,
)
from dynamod.integrations.verl.stack import check_settings, diagnose, parse_status
from dynamod.integrations.verl.version import check_verl_version


def status(held: list[str] | None = None, states: tuple[str, str] = ("ready", "ready"),
           router: str = "kv", phase: str = "up") -> dict[str, Any]:
    workers = [
        {"name": f"worker@{i}", "state": states[i], "ports": {"system": 21000 + i},
         "command": ["python", "-m", "dynamod.workers.cpu", "--model-name", "tiny-cpu"],
         "dynamo": {"namespace": "dynamod", "system_url": f"http://127.0.0.1:{21000 + i}",
                    "instance_ids": [100 + i], "routed": True},
         "policy_version": 3}
        for i in range(2)
    ]
    return {
        "stack": "verl-cpu", "state_dir": "/tmp/x", "phase": phase,
        "policy": {"current": 3, "held": held or []},
        "units": [
            *workers,
            {"name": "frontend", "state": "ready", "ports": {"http": 24000},
             "command": ["python", "-m", "dynamo.frontend", "--router-mode", router]},
            {"name": "ray-head", "state": "ready", "ports": {"gcs": 25000}, "command": ["ray"]},
        ],
    }


def test_settings_keep_request_keys_and_refuse_what_dynamod_owns() -> None:
    s = parse_settings({"dynamo": {"request_completion_token_ids": "true",
                                   "request_timeout_s": 30, "router_mode": "kv",
                                   "enable_worker_system_metrics": True}})
    assert s.request_completion_token_ids and s.request_timeout_s == 30.0
    assert s.router_mode == "kv"
    assert [k for k, _ in s.ignored] == [
        "actor_rollout_ref.rollout.engine_kwargs.dynamo.enable_worker_system_metrics"]
    with pytest.raises(RolloutConfigError, match=r"engine_kwargs\.dynamo\.nats_port: owned by"):
        parse_settings({"dynamo": {"nats_port": 4222}})
    with pytest.raises(RolloutConfigError, match=r"dynamod\.bogus: unknown key"):
        parse_settings({"dynamod": {"bogus": 1}})
    with pytest.raises(RolloutConfigError, match=r"router_mode: 'fastest' is not a router mode"):
        parse_settings({"dynamod": {"router_mode": "fastest"}})
    with pytest.raises(RolloutConfigError, match=r"thunderagent\.router_block_size: owned by"):
        parse_settings({"dynamo": {"thunderagent": {"enabled": False, "router_block_size": 16}}})
    assert parse_settings({}).push_serving is None  # every shard before verl goes on
    assert parse_settings({"dynamod": {"push_serving": 2}}).push_serving == 2
    with pytest.raises(RolloutConfigError, match=r"dynamod\.push_serving: "):
        parse_settings({"dynamod": {"push_serving": 0}})


def test_a_router_mode_that_conflicts_with_the_stack_is_refused_with_the_key() -> None:
    view = parse_status(status(router="round-robin"))
    check_settings(view, parse_settings({"dynamod": {"router_mode": "round-robin"}}))
    with pytest.raises(RolloutConfigError, match=r"dynamod\.router_mode: 'kv' conflicts"):
        check_settings(view, parse_settings({"dynamod": {"router_mode": "kv"}}))
    with pytest.raises(RolloutConfigError, match=r"thunderagent\.enabled: True conflicts"):
        check_settings(view, parse_settings({"dynamod": {"thunderagent": {"enabled": True}}}))


def test_the_stack_view_reads_status_json() -> None:
    view = parse_status(status(held=["worker@1"]))
    assert view.frontend_url == "http://127.0.0.1:24000" and view.router_mode == "kv"
    assert view.model == "tiny-cpu" and view.namespace == "dynamod"
    assert view.ray_address == "127.0.0.1:25000" and view.current_version == 3
    assert [s.name for s in view.admitted] == ["worker@0"]
    assert [s.name for s in view.shards_of_replica(1, 2)] == ["worker@1"]


def test_diagnosis_refuses_too_few_admitted_shards_and_a_stack_not_up() -> None:
    diagnose(parse_status(status()), needed_shards=2)
    with pytest.raises(StackNotReadyError, match=r"1 admitted rollout shard\(s\) \(worker@0\)"
                       r" but verl's rollout layout needs 2.*worker@1 ready held"):
        diagnose(parse_status(status(held=["worker@1"])), needed_shards=2)
    with pytest.raises(StackNotReadyError, match=r"is 'starting', not up"):
        diagnose(parse_status(status(phase="starting")), needed_shards=1)


def test_request_requires_the_policy_taint_and_asks_for_engine_tokens() -> None:
    body = build_request(model="m", prompt_ids=[1, 2], sampling_params={
        "temperature": 0.5, "top_k": -1, "logprobs": True, "max_tokens": 9},
        max_tokens=9, version=4, settings=RolloutSettings(), request_id="r")
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 9 and body["logprobs"] == 0
    assert "top_k" not in body and body["temperature"] == 0.5
    assert body["nvext"]["routing_constraints"] == {"required_taints": ["dynamod.policy/4"]}
    assert {"completion_token_ids", "engine_data"} <= set(body["nvext"]["extra_fields"])


def test_response_token_ids_and_logprobs_must_match() -> None:
    good = {"choices": [{"finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.1, -2.0]}}],
            "nvext": {"completion_token_ids": [5, 6],
                      "engine_data": {"weight_version": 4, "instance_id": 7}}}
    c = parse_response(good, want_log_probs=True, version=4)
    assert (c.token_ids, c.log_probs, c.stop_reason) == ([5, 6], [-0.1, -2.0], "completed")
    assert c.extra["global_steps"] == 4 and c.extra["instance_id"] == 7
    bad = {**good, "nvext": {"completion_token_ids": [5, 6, 7]}}
    with pytest.raises(GenerationError, match="3 completion token ids but 2 logprobs"):
        parse_response(bad, want_log_probs=True, version=4)
    cancelled = {"choices": [{"finish_reason": "cancelled"}], "nvext": {"completion_token_ids": []}}
    assert parse_response(cancelled, want_log_probs=False, version=4).stop_reason == "aborted"
    with pytest.raises(GenerationError, match="no completion token ids"):
        parse_response({"choices": [{"text": "x"}]}, want_log_probs=False, version=4)


def test_an_unsupported_verl_is_refused_naming_the_supported_versions() -> None:
    assert check_verl_version("0.9.1") == "0.9.1"
    with pytest.raises(UnsupportedVerlError, match=r"verl 0\.8\.0 is not supported.*0\.9\.1"):
        check_verl_version("0.8.0")
    with pytest.raises(UnsupportedVerlError, match="not installed"):
        check_verl_version(None)


def test_token_boundary_check_fails_on_missing_or_uneven_logprobs() -> None:
    from dynamod.integrations.verl.completions import Completion
    from dynamod.integrations.verl.validate import judge_tokens

    ok = Completion([1, 2], [-0.1, -0.2], "completed", "length")
    assert judge_tokens([ok, Completion([], [], "aborted", "cancelled")]) == (
        True, "1 completed, 1 aborted, 0 failed")
    assert not judge_tokens([ok, Completion([1, 2], [-0.1], "completed", "stop")])[0]
    assert not judge_tokens([Completion([1], None, "completed", "stop")])[0]
    assert not judge_tokens([ok, RuntimeError("HTTP 500")])[0]


def test_step_boundary_check_fails_on_a_stale_shard_or_stale_generation() -> None:
    from dynamod.integrations.verl.validate import judge_steps

    policy = {"current": 2, "shards": [{"name": "w0", "policy_version": 2, "admitted": True},
                                       {"name": "w1", "policy_version": 2, "admitted": True}]}
    assert judge_steps(policy, 2, [2, 2])[0]
    stale = {**policy, "shards": [*policy["shards"][:1],
                                  {"name": "w1", "policy_version": 1, "admitted": False}]}
    assert not judge_steps(stale, 2, [2])[0]
    assert not judge_steps(policy, 3, [2])[0]
    assert not judge_steps(policy, 2, [1])[0]


def test_a_served_version_comes_from_the_engine_or_else_from_the_shard_that_served_it() -> None:
    """dynamo.vllm 1.6.1 returns no engine_data: the version is the serving shard's (found
    by the instance in `worker_id`), and a request from an unknown worker has none."""
    from dynamod.integrations.verl.validate import judge_steps, served_versions

    def done(**extra: Any) -> Completion:
        return Completion([1], [-0.1], "completed", "stop", extra=extra)

    units = [{"name": "worker@0", "policy_version": 3, "dynamo": {"instance_ids": [7, 8]}},
             {"name": "worker@1", "policy_version": 2, "dynamo": {"instance_ids": [9]}},
             {"name": "frontend"}]  # fmt: skip
    results = [done(weight_version=3, worker_id=9), done(weight_version=None, worker_id=8),
               done(worker_id=9), done(worker_id=5), RuntimeError("HTTP 500")]  # fmt: skip
    assert served_versions(results, units) == [
        (3, "engine"), (3, "shard"), (2, "shard"), (None, "unknown (worker 5)")]
    policy = {"current": 3, "shards": [{"name": "worker@0", "policy_version": 3, "admitted": True}]}
    assert judge_steps(policy, 3, [v for v, _ in served_versions(results[:2], units)])[0]
    assert not judge_steps(policy, 3, [v for v, _ in served_versions(results[:3], units)])[0]
