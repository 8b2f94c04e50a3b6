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


def test_a_line_the_parser_refuses_costs_that_line_not_the_others() -> None:
    text = "\n".join([LINE.format(ns="local_serve", id="67faa23a11393b15"),
                      "this is { no sample",
                      LINE.format(ns="local_serve", id="ab")])  # fmt: skip
    assert worker_ids_in_metrics(text, "local-serve") == {0x67FAA23A11393B15, 0xAB}


def test_labels_are_read_as_the_format_has_them_not_by_pattern() -> None:
    # an escaped quote inside another label, and the worker_id label first
    text = ('dynamo_component_requests_total{worker_id="1f",note="a \\"quoted\\" x",'
            'dynamo_namespace="dynamo"} 3\n'
            'dynamo_component_requests_total{dynamo_namespace="dynamo",worker_id="not-hex"} 1\n')
    assert worker_ids_in_metrics(text, "dynamo") == {0x1F}
