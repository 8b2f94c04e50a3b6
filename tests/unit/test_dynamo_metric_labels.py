"""The runtime labels its metrics with the namespace as a Prometheus-safe name (`-` -> `_`);
a worker of a stack named `local-serve` must still be found by its instance id."""

from __future__ import annotations

from dynamod.rollout.dynamo import namespace_label, worker_ids_in_metrics

LINE = ('dynamo_component_inflight_requests{{dynamo_component="backend",'
        'dynamo_endpoint="generate",dynamo_namespace="{ns}",worker_id="{id}"}} 0')
METRICS = "\n".join([
    "# HELP dynamo_component_inflight_requests in flight",
    LINE.format(ns="local_serve", id="67faa23a11393b15"),
    LINE.format(ns="other", id="ff"),
])


def test_a_dashed_namespace_matches_its_underscored_label() -> None:
    assert worker_ids_in_metrics(METRICS, "local-serve") == {0x67FAA23A11393B15}


def test_another_namespace_is_not_matched() -> None:
    assert worker_ids_in_metrics(METRICS, "local") == set()
    assert worker_ids_in_metrics(METRICS, "other") == {0xFF}


def test_label_form() -> None:
    assert namespace_label("vllm-cpu") == "vllm_cpu"
    assert namespace_label("plain_ns1") == "plain_ns1"
