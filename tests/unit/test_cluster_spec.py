"""[cluster] tables, unit placement, the node context and env, cross-node stand-ins and
the cluster-wide stop tiers (pure: no process, no network)."""

import itertools
import textwrap
from pathlib import Path

import pytest

from dynamod.core import placement, spec
from dynamod.core.errors import SpecErrors

STACK = """
    [cluster]
    nodes = { head = "10.9.0.1", n1 = "10.9.0.2", n2 = "10.9.0.3" }
    lease_ttl = 2
    [vars]
    etcd_client_port = 2379
    [units.etcd]
    command = ["etcd", "--listen", "http://{node.address}:{ports.client}"]
    ports = { client = "{vars.etcd_client_port}" }
    ready = { kind = "http", url = "http://{node.address}:{ports.client}/health" }
    [units.worker]
    nodes = "all"
    replicas = 1
    command = ["w", "{node.name}", "{cluster.head_address}", "{cluster.nodes.n2}",
               "{cluster.nodes_spec}"]
    ports = { system = 0 }
    depends_on = { etcd = "ready" }
    [units.frontend]
    command = ["fe"]
    depends_on = { etcd = "ready", worker = "started" }
    [units.trainer]
    nodes = ["head"]
    command = ["t", "{cluster.secrets}"]
    depends_on = { frontend = "ready" }
"""


def load(tmp_path: Path, text: str, node: str | None = None) -> spec.Stack:
    path = tmp_path / "stack.toml"
    path.write_text(textwrap.dedent(text))
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter),
                     node=node)


def one_error(tmp_path: Path, text: str, node: str | None = None) -> str:
    with pytest.raises(SpecErrors) as info:
        load(tmp_path, text, node)
    assert len(info.value.errors) == 1
    return str(info.value.errors[0])


def test_the_head_runs_its_units_and_each_node_gets_its_context_and_env(tmp_path: Path) -> None:
    head = load(tmp_path, STACK)
    assert head.cluster is not None and head.cluster.node == "head" and head.cluster.lease_ttl == 2
    assert head.cluster.heartbeat_timeout == 1.2  # the default
    for given, meant in (("0", 0.0), ("0.6", 0.6), ("2", 2.0)):
        text = STACK.replace("lease_ttl = 2", f"lease_ttl = 2\nheartbeat_timeout = {given}")
        beating = load(tmp_path, text).cluster
        assert beating is not None and beating.heartbeat_timeout == meant
    assert list(head.units) == ["etcd", "worker@0", "frontend", "trainer"]
    assert all(u.remote is None for u in head.units.values())
    worker = head.units["worker@0"]
    spec_text = "head=10.9.0.1,n1=10.9.0.2,n2=10.9.0.3"
    assert worker.command == ["w", "head", "10.9.0.1", "10.9.0.3", spec_text]
    assert worker.env == {"DYNAMOD_NODE": "head", "DYNAMOD_CLUSTER_NODES": spec_text,
                          "DYNAMOD_CLUSTER_HEAD": "head"}
    assert head.units["trainer"].command == ["t", ""]  # no secrets dir
    assert head.cluster.registry == ["http://10.9.0.1:2379"]
    assert head.cluster.placement["worker"] == ["head", "n1", "n2"]
    assert head.cluster.stop_tiers == [["trainer"], ["frontend"], ["worker"], ["etcd"]]


def test_another_node_runs_its_share_and_checks_the_head_s_units_there(tmp_path: Path) -> None:
    n1 = load(tmp_path, STACK, node="n1")
    assert list(n1.units) == ["etcd", "worker@0"]
    etcd = n1.units["etcd"]
    assert etcd.remote == "head" and etcd.depends_on == {}
    assert isinstance(etcd.ready, spec.HttpProbe)
    assert etcd.ready.url == "http://10.9.0.1:2379/health"
    worker = n1.units["worker@0"]
    assert worker.remote is None and worker.command[1] == "n1"
    assert worker.env["DYNAMOD_NODE"] == "n1"
    assert worker.depends_on == {"etcd": "ready"}


def test_bad_cluster_tables_and_nodes_are_named(tmp_path: Path) -> None:
    assert "field '--node'" in one_error(tmp_path, STACK, node="n9")
    assert "not in the stack's [cluster] nodes" in one_error(tmp_path, STACK, node="n9")
    plain = '[units.a]\ncommand = ["a"]\n'
    assert "needs a stack with a [cluster] table" in one_error(tmp_path, plain, node="n1")
    placed = '[units.a]\ncommand = ["a"]\nnodes = "all"\n'
    assert "unit 'a', field 'nodes'" in one_error(tmp_path, placed)
    unknown = STACK.replace('nodes = ["head"]', 'nodes = ["nx"]')
    assert "unknown node 'nx'" in one_error(tmp_path, unknown)
    bad_head = STACK.replace("lease_ttl = 2", 'head = "n7"')
    assert "field 'cluster.head'" in one_error(tmp_path, bad_head)
    bad_ttl = STACK.replace("lease_ttl = 2", "lease_ttl = 0")
    assert "field 'cluster.lease_ttl'" in one_error(tmp_path, bad_ttl)
    for bad in ("0.3", "-1", "61", "true", '"1.2"'):
        beat = STACK.replace("lease_ttl = 2", f"lease_ttl = 2\nheartbeat_timeout = {bad}")
        assert "field 'cluster.heartbeat_timeout'" in one_error(tmp_path, beat), bad
    extra = STACK.replace("lease_ttl = 2", "lease_ttl = 2\nreplicas = 3")
    assert "field 'cluster.replicas'" in one_error(tmp_path, extra)
    own_remote = STACK.replace('command = ["fe"]', 'command = ["fe"]\nremote = "n1"')
    assert "field 'remote'" in one_error(tmp_path, own_remote)


def test_a_cross_node_dependency_needs_a_probe_and_fixed_ports(tmp_path: Path) -> None:
    no_probe = STACK.replace(
        'ready = { kind = "http", url = "http://{node.address}:{ports.client}/health" }', "")
    message = one_error(tmp_path, no_probe, node="n2")
    assert "unit 'etcd', field 'ready'" in message and "runs on node head" in message
    allocated = STACK.replace('ports = { client = "{vars.etcd_client_port}" }',
                              "ports = { client = 0 }")
    assert "needs a fixed port" in one_error(tmp_path, allocated, node="n2")
    load(tmp_path, allocated)  # on the head itself an allocated port is fine


def test_stop_tiers_put_dependents_first() -> None:
    edges = {"etcd": [], "nats": [], "worker": ["etcd", "nats"], "frontend": ["worker"],
             "trainer": ["frontend"], "model": []}
    tiers = placement.stop_tiers(edges)
    assert set(tiers[0]) == {"trainer", "model"}  # nothing depends on either: stop at once
    assert tiers[1:] == [["frontend"], ["worker"], ["etcd", "nats"]]


def test_others_places_a_unit_on_every_node_but_the_head(tmp_path: Path) -> None:
    text = STACK.replace('nodes = ["head"]', 'nodes = "others"').replace(
        'depends_on = { frontend = "ready" }', "")
    stack = load(tmp_path, text)
    assert stack.cluster is not None and stack.cluster.placement["trainer"] == ["n1", "n2"]
    assert "trainer" not in stack.units  # not on the head
    assert "trainer" in load(tmp_path, text, node="n2").units
    alone = text.replace('nodes = { head = "10.9.0.1", n1 = "10.9.0.2", n2 = "10.9.0.3" }',
                         'nodes = { head = "10.9.0.1" }').replace(', "{cluster.nodes.n2}"', "")
    assert "\"others\" leaves no node: the cluster has only its head 'head'" in one_error(
        tmp_path, alone)
