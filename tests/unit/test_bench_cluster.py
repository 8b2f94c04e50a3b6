"""bench.cluster's lease variants and bench.fleet's shard settings (bench/fleet_stack.py
`with_lease`, `with_heartbeat`, `with_shard_limits`, `with_shard_live_timeout`,
`with_modeled_reset`, `with_etcd_metrics`): the stock
cluster stack rewritten for a registry lease, with the etcd election timeout a 1 s lease
needs, for the leader's heartbeat timeout (or none), with
limits (a CPU weight, a nice) on its shards, a longer liveness timeout, a modeled engine
reset or etcd's extensive metrics; or refused when a line it rewrites is not there."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bench.cluster import STACK
from bench.fleet_stack import (
    ELECTION_TIMEOUT_MS,
    StackShapeError,
    with_etcd_metrics,
    with_heartbeat,
    with_lease,
    with_modeled_reset,
    with_shard_limits,
    with_shard_live_timeout,
)

UNITS = Path("/units")


def test_the_stack_s_own_lease_changes_only_the_includes() -> None:
    text = with_lease(STACK.read_text(), 2, UNITS)
    assert text == STACK.read_text().replace('"../', '"/units/')
    assert tomllib.loads(text)["stack"]["include"] == ["/units/trainer.toml"]


def test_the_heartbeat_timeout_is_set_or_turned_off_and_refused_without_its_line() -> None:
    assert tomllib.loads(STACK.read_text())["cluster"]["heartbeat_timeout"] == 1.2
    for timeout in (0, 0.8, 2):
        cluster = tomllib.loads(with_heartbeat(STACK.read_text(), timeout))["cluster"]
        assert cluster["heartbeat_timeout"] == timeout and cluster["lease_ttl"] == 2
    assert with_heartbeat(STACK.read_text(), None) == STACK.read_text()
    without = STACK.read_text().replace("heartbeat_timeout", "# heartbeat")
    with pytest.raises(StackShapeError, match=r"cluster\.heartbeat_timeout"):
        with_heartbeat(without, 0)


def test_a_1_s_lease_sets_the_lease_and_etcd_s_election_timeout() -> None:
    text = with_lease(STACK.read_text(), 1, UNITS)
    stack = tomllib.loads(text)
    assert stack["cluster"]["lease_ttl"] == 1
    command = stack["units"]["etcd"]["command"]
    at = command.index("--election-timeout")
    assert command[at + 1] == str(ELECTION_TIMEOUT_MS[1])
    assert "--election-timeout" not in str(stack["units"]["nats"]["command"])


@pytest.mark.parametrize(
    ("text", "lease", "missing"),
    [
        ('[cluster]\n[units.etcd]\ncommand = [\n    "--initial-cluster", "x",\n]\n', 2,
         "cluster.lease_ttl"),
        ("[cluster]\nlease_ttl = 2\n[units.etcd]\ncommand = []\n", 1, "etcd --initial-cluster"),
    ],
)  # fmt: skip
def test_a_stack_it_cannot_rewrite_is_refused(text: str, lease: int, missing: str) -> None:
    with pytest.raises(StackShapeError, match=f"no {missing} line"):
        with_lease(text, lease, UNITS)


def test_shard_limits_limit_the_workers_alone() -> None:
    stack = tomllib.loads(with_shard_limits(STACK.read_text(), {"cpu_weight": 20, "nice": 10}))
    assert stack["units"]["worker"]["limits"] == {"cpu_weight": 20, "nice": 10}
    assert all("limits" not in u for name, u in stack["units"].items() if name != "worker")
    assert with_shard_limits(STACK.read_text(), {}) == STACK.read_text()
    with pytest.raises(StackShapeError, match=r"no units\.worker line"):
        with_shard_limits("[units.frontend]\ndescription = 'x'\n", {"nice": 10})


def test_a_shard_live_timeout_changes_the_workers_liveness_timeout_alone() -> None:
    stock = tomllib.loads(STACK.read_text())
    stack = tomllib.loads(with_shard_live_timeout(STACK.read_text(), 12.5))
    assert stack["units"]["worker"]["live"] == {**stock["units"]["worker"]["live"], "timeout": 12.5}
    for name, unit in stack["units"].items():  # etcd's, NATS's, the frontend's: as they were
        if name != "worker":
            assert unit == stock["units"][name], name
    assert with_shard_live_timeout(STACK.read_text(), None) == STACK.read_text()
    with pytest.raises(StackShapeError, match=r"no units\.worker live line"):
        with_shard_live_timeout('live = { kind = "http", url = "x", timeout = 2 }\n', 10)


def test_a_modeled_reset_is_one_more_flag_of_the_workers_alone() -> None:
    stock = tomllib.loads(STACK.read_text())
    stack = tomllib.loads(with_modeled_reset(STACK.read_text(), 0.05))
    command, before = stack["units"]["worker"]["command"], stock["units"]["worker"]["command"]
    at = before.index("{vars.worker_engine}") + 1  # right after the engine it models
    assert command == [*before[:at], "--modeled-reset-s", "0.05", *before[at:]]
    for name, unit in stack["units"].items():
        if name != "worker":
            assert unit == stock["units"][name], name
    assert with_modeled_reset(STACK.read_text(), None) == STACK.read_text()
    with pytest.raises(StackShapeError, match=r"no units\.worker --engine line"):
        with_modeled_reset('command = ["x", "--engine", "mocker"]\n', 0.05)


def test_etcd_s_extensive_metrics_are_one_more_flag_of_etcd_alone() -> None:
    stock = tomllib.loads(STACK.read_text())
    stack = tomllib.loads(with_etcd_metrics(STACK.read_text(), "extensive"))
    command = stack["units"]["etcd"]["command"]
    assert command[command.index("--metrics") + 1] == "extensive"
    assert sorted(command) == sorted([*stock["units"]["etcd"]["command"], "--metrics", "extensive"])
    for name, unit in stack["units"].items():
        if name != "etcd":
            assert unit == stock["units"][name], name
    assert with_etcd_metrics(STACK.read_text(), None) == STACK.read_text()
    with pytest.raises(StackShapeError, match=r"no etcd --initial-cluster line"):
        with_etcd_metrics('command = ["etcd"]\n', "extensive")


def test_what_marked_a_node_lost_is_read_from_its_record_s_why() -> None:
    from dynamod.chaos.node_loss import lost_by
    from dynamod.cluster.registry import LEASE_EXPIRED

    assert lost_by("silent for 1.3s (heartbeat)") == "heartbeat"
    assert lost_by(LEASE_EXPIRED) == "lease"
    assert lost_by("") == "-"
