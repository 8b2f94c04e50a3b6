import pytest

from dynamod.core import graph


def test_start_order_puts_dependencies_first() -> None:
    edges = {"frontend": ["worker"], "worker": ["etcd", "nats"], "etcd": [], "nats": []}
    order = graph.start_order(edges)
    assert order.index("etcd") < order.index("worker") < order.index("frontend")
    assert order.index("nats") < order.index("worker")


def test_stop_order_is_the_reverse() -> None:
    edges = {"a": [], "b": ["a"], "c": ["b"]}
    assert graph.stop_order(edges) == ["c", "b", "a"]


def test_cycle_is_spelled_out() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a"]}
    with pytest.raises(graph.Cycle) as info:
        graph.start_order(edges)
    assert info.value.cycle == ["a", "b", "c", "a"]
    assert str(info.value) == "a -> b -> c -> a"


def test_self_loop_is_a_cycle() -> None:
    with pytest.raises(graph.Cycle) as info:
        graph.start_order({"a": ["a"]})
    assert info.value.cycle == ["a", "a"]


def test_levels_group_parallel_starts() -> None:
    edges = {"etcd": [], "nats": [], "w0": ["etcd", "nats"], "w1": ["etcd", "nats"],
             "fe": ["w0", "w1"]}
    assert graph.levels(edges) == [["etcd", "nats"], ["w0", "w1"], ["fe"]]


def test_dependents_inverts_edges() -> None:
    assert graph.dependents({"a": [], "b": ["a"], "c": ["a"]}) == {"a": ["b", "c"], "b": [],
                                                                   "c": []}
