"""How a node-loss round judges its request history (pure): what counts against the
target of 0 failures after re-routing and what is counted apart."""

from dynamod.chaos.history import Request
from dynamod.chaos.node_loss import NodeLossRound


def test_failures_after_re_routing_count_and_refusals_at_the_outgoing_version_do_not() -> None:
    r = NodeLossRound(node="n2", step=1, cut_at=10.0, rerouted_at=13.0,
                      push_started_at=15.0, push_done_at=16.0)
    r.requests = [
        Request(sent=11.0, done=21.0, status=-1, required=0),  # routed to the cut node
        Request(sent=14.0, done=14.1, status=200, required=0),
        Request(sent=15.5, done=15.6, status=500, required=0),  # outgoing version mid-push
        Request(sent=17.0, done=17.1, status=500, required=1),  # a real failure
        Request(sent=18.0, done=18.1, status=500, required=None),  # plain traffic: not judged
    ]
    assert [q.sent for q in r.failed_during_cut()] == [11.0]
    assert [q.sent for q in r.refused_at_outgoing_version()] == [15.5]
    assert [q.sent for q in r.failed_after_reroute()] == [17.0]
    r.requests = r.requests[:3]
    assert r.failed_after_reroute() == []
