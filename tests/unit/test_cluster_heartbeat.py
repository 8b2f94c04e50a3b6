"""Node heartbeats (dynamod/cluster/heartbeat.py): the judge of silence, pure, and the echo
and the pinger over real UDP sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamod.cluster import heartbeat
from dynamod.cluster.heartbeat import Heard, Pinger, Responder, judge


def silent(heard: Heard, armed: set[str], timeout: float) -> list[str]:
    """The nodes the judgment marks lost."""
    return judge(heard, armed, timeout).lost


def rounds(now: float, every: float = 0.2, span: float = 5.0) -> tuple[float, ...]:
    """A pinger's rounds that went out every `every` s over the last `span` s."""
    count = int(span / every)
    return tuple(now - span + every * i for i in range(count + 1))


def test_a_node_that_answered_and_fell_silent_for_the_timeout_is_judged() -> None:
    now = 100.0
    heard = Heard(now, {"n1": now - 1.3, "n2": now - 0.1}, rounds(now))
    assert silent(heard, {"n1", "n2"}, 1.2) == ["n1"]
    assert silent(Heard(now, {"n1": now - 1.0}, rounds(now)), {"n1"}, 1.2) == []


def test_a_node_never_heard_or_not_armed_is_left_to_its_lease() -> None:
    now = 100.0
    heard = Heard(now, {"n1": now - 9.0}, rounds(now))
    assert silent(heard, {"n2"}, 1.2) == []  # n2 never answered: a blocked port, say
    assert silent(heard, set(), 1.2) == []  # n1 judged already, not answered since


def test_a_starved_pinger_judges_no_one() -> None:
    now = 100.0
    steady = rounds(now - 1.0, span=4.0)  # its rounds stopped a second ago
    assert silent(Heard(now, {"n1": now - 1.5}, steady), {"n1"}, 1.2) == []
    gap = tuple(t for t in rounds(now) if not now - 1.0 < t < now - 0.4)  # a 0.6 s gap
    assert silent(Heard(now, {"n1": now - 1.5}, gap), {"n1"}, 1.2) == []
    assert silent(Heard(now, {"n1": now - 1.5}, ()), {"n1"}, 1.2) == []
    started = rounds(now, span=0.5)  # it began pinging half a second ago
    assert silent(Heard(now, {"n1": now - 1.5}, started), {"n1"}, 1.2) == []
    missed = tuple(t for t in rounds(now) if not now - 0.7 < t < now - 0.4)  # one round
    assert silent(Heard(now, {"n1": now - 1.5}, missed), {"n1"}, 1.2) == ["n1"]


def test_a_silence_left_to_the_lease_says_why() -> None:
    now = 100.0
    steady = rounds(now - 1.0, span=4.0)
    starved = heartbeat.judge(Heard(now, {"n1": now - 1.5}, steady), {"n1"}, 1.2)
    assert starved.lost == [] and starved.overdue == ["n1"]
    assert "pings stopped for 1.00s" in starved.withheld
    old = now - 2.0
    crowd = heartbeat.judge(Heard(now, {"a": old, "b": old, "c": now}, rounds(now)),
                            {"a", "b", "c"}, 1.2)  # fmt: skip
    assert crowd.overdue == ["a", "b"] and "2 of 3 nodes silent at once" in crowd.withheld
    clear = heartbeat.judge(Heard(now, {"a": now - 0.3}, ()), {"a"}, 1.2)
    assert clear == heartbeat.Judgment([], [])  # none overdue: nothing to say


def test_most_of_the_cluster_silent_at_once_is_left_to_the_leases() -> None:
    now = 100.0
    old = now - 2.0
    three = Heard(now, {"a": old, "b": old, "c": now}, rounds(now))
    assert silent(three, {"a", "b", "c"}, 1.2) == []  # 2 of 3: the leader's own link?
    four = Heard(now, {"a": old, "b": old, "c": now, "d": now}, rounds(now))
    assert silent(four, {"a", "b", "c", "d"}, 1.2) == ["a", "b"]  # half: judged
    two = Heard(now, {"a": old, "b": old}, rounds(now))
    assert silent(two, {"a", "b"}, 1.2) == ["a", "b"]  # too few nodes to tell


def test_nodes_silenced_together_count_as_at_once_though_one_crossed_the_timeout_first() -> None:
    """A link cut at the leader silences every node within a round or two: the first to
    cross the timeout is not judged alone while the others are near it (CI: two of three
    silenced together, the first judged 0.07 s before the second, both revoked). A healthy
    node's silence (a ping round) stays far from it, and a lone silent node is judged."""
    now, timeout = 100.0, 1.2
    skewed = Heard(now, {"a": now - 1.25, "b": now - 1.0, "c": now - 0.1}, rounds(now))
    judged = heartbeat.judge(skewed, {"a", "b", "c"}, timeout)
    assert judged.lost == [] and judged.overdue == ["a"], judged
    assert "2 of 3 nodes silent at once" in judged.withheld
    healthy = Heard(now, {"a": now - 1.25, "b": now - 0.25, "c": now - 0.1}, rounds(now))
    assert silent(healthy, {"a", "b", "c"}, timeout) == ["a"]
    # the test's own 0.6 s timeout: "near" is at least half of it, not within a ping round
    quick = Heard(now, {"a": now - 0.62, "b": now - 0.55, "c": now - 0.21}, rounds(now))
    assert silent(quick, {"a", "b", "c"}, 0.6) == []
    lone = Heard(now, {"a": now - 0.62, "b": now - 0.21, "c": now - 0.05}, rounds(now))
    assert silent(lone, {"a", "b", "c"}, 0.6) == ["a"]


@given(st.binary(max_size=600))
def test_any_datagram_parses_or_is_refused_without_raising(data: bytes) -> None:
    got = heartbeat.parse(data)
    assert got is None or heartbeat.datagram(*got) == data


def test_a_datagram_reads_back() -> None:
    assert heartbeat.parse(heartbeat.datagram("stack-a", "n1", 42)) == ("stack-a", "n1", 42)
    assert heartbeat.parse(b"dynamod-heartbeat-1\0s\0n\0x") is None
    assert heartbeat.parse(b"other\0s\0n\x001") is None


@pytest.fixture
def responder() -> Iterator[Responder]:
    echo = Responder("127.0.0.1")
    try:
        yield echo
    finally:
        echo.close()


def _wait_heard(pinger: Pinger, name: str, after: float, within: float = 3.0) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        when = pinger.heard().answered.get(name)
        if when is not None and when > after:
            return when
        time.sleep(0.02)
    raise AssertionError(f"{name} not heard within {within}s")


def test_the_pinger_hears_the_echo_and_then_its_silence(responder: Responder) -> None:
    pinger = Pinger("stack-a", interval=0.05)
    try:
        pinger.aim({"n1": ("127.0.0.1", responder.port)})
        _wait_heard(pinger, "n1", 0.0)
        assert silent(pinger.heard(), {"n1"}, 0.6) == []
        responder.close()
        time.sleep(0.9)
        heard = pinger.heard()
        assert heard.now - heard.answered["n1"] >= 0.6
        assert silent(heard, {"n1"}, 0.6) == ["n1"]
    finally:
        pinger.close()


def test_a_new_port_must_answer_again_before_it_counts(responder: Responder) -> None:
    pinger = Pinger("stack-a", interval=0.05)
    try:
        pinger.aim({"n1": ("127.0.0.1", responder.port)})
        _wait_heard(pinger, "n1", 0.0)
        pinger.aim({"n1": ("127.0.0.1", 9)})  # a new daemon, say: nothing answers there
        assert "n1" not in pinger.heard().answered
        pinger.aim({"n1": ("127.0.0.1", responder.port)})
        _wait_heard(pinger, "n1", 0.0)
    finally:
        pinger.close()


def test_an_answer_for_another_node_or_stack_is_not_counted() -> None:
    """A socket that answers each ping with another node's name, or another stack's, or a
    sequence number the pinger never sent: the node it was sent to stays unheard."""
    liar = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    liar.bind(("127.0.0.1", 0))
    liar.settimeout(0.2)
    stop = threading.Event()

    def lie() -> None:
        forged = [heartbeat.datagram("stack-a", "n2", 1), heartbeat.datagram("stack-b", "n1", 1),
                  heartbeat.datagram("stack-a", "n1", 10**9)]  # fmt: skip
        n = 0
        while not stop.is_set():
            try:
                _, peer = liar.recvfrom(heartbeat.MAX_DATAGRAM)
            except TimeoutError:
                continue
            liar.sendto(forged[n % len(forged)], peer)
            n += 1

    thread = threading.Thread(target=lie, daemon=True)
    thread.start()
    pinger = Pinger("stack-a", interval=0.05)
    try:
        pinger.aim({"n1": ("127.0.0.1", liar.getsockname()[1])})
        time.sleep(0.6)
        assert pinger.heard().answered == {}
    finally:
        pinger.close()
        stop.set()
        thread.join(1.0)
        liar.close()


def test_a_responder_on_an_address_it_cannot_bind_raises() -> None:
    with pytest.raises(OSError):
        Responder("192.0.2.1")  # TEST-NET-1: on no interface here


def test_a_ping_after_a_silence_says_the_link_is_back(
    responder: Responder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`back_at` moves on the first ping after BACK_AFTER_S without one, not on the pings
    that follow it closely (real UDP on loopback)."""
    monkeypatch.setattr(heartbeat, "BACK_AFTER_S", 0.3)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ping = heartbeat.datagram("stack-a", "n1", 1)

    def ping_and_wait() -> float | None:
        sender.sendto(ping, ("127.0.0.1", responder.port))
        sender.settimeout(2)
        sender.recvfrom(heartbeat.MAX_DATAGRAM)  # its echo: the ping was taken
        return responder.back_at

    try:
        assert responder.back_at is None
        first = ping_and_wait()
        assert first is not None
        time.sleep(0.05)
        assert ping_and_wait() == first  # pinged throughout: not back
        time.sleep(0.4)
        later = ping_and_wait()
        assert later is not None and later > first  # after a silence: back
    finally:
        sender.close()
