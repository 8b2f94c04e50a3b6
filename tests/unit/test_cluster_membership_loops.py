"""The membership's background loops (pure asyncio, no etcd): a CancelledError that is no
cancel of the loop's task (gRPC raises one in a call whose channel another call closed) is a
failed round, not the loop's end; a loop that ends anyway is logged and started again; a
real cancel (stop) ends them for good."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from dynamod.cluster import membership
from dynamod.cluster.membership import Membership
from dynamod.core.phase import Phase
from dynamod.core.placement import ClusterSpec
from dynamod.rollout.etcd import EtcdError
from dynamod.rollout.etcd.records import KeyValue, WatchEvent

SPEC = ClusterSpec(nodes={"head": "10.1.0.1"}, head="head", node="head",
                   registry=["http://10.1.0.1:2379"])  # fmt: skip


def _membership() -> Membership:
    return Membership(SPEC, registrations=Any, policy=None)  # type: ignore[arg-type]


def _reading(monkeypatch: pytest.MonkeyPatch, etcd: object) -> Membership:
    """A membership whose read loop polls fast and reads from `etcd`."""
    monkeypatch.setattr(membership, "READ_FALLBACK_S", 0.01)
    monkeypatch.setattr(membership, "READ_GAP_S", 0.01)
    member = _membership()
    member.host = SimpleNamespace(stack=SimpleNamespace(name="s"), phase=Phase.UP)  # type: ignore[assignment]
    member.etcd = etcd  # type: ignore[assignment]
    return member


class _ClosedUnderCalls:
    """Stands in for the etcd client: its first reads fail as gRPC fails a call whose
    channel another call closed (a bare CancelledError), then it answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.reads = 0

    async def get_prefix_at(self, prefix: str) -> tuple[list[Any], int]:
        self.reads += 1
        if self.reads <= self.failures:
            raise asyncio.CancelledError
        return [], 1


async def _until(done: Callable[[], bool], timeout: float = 5.0) -> None:
    """Until `done()` holds or `timeout` s passed (the assertion after it says which)."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_a_stray_cancelled_error_is_a_failed_round_and_a_stop_still_ends_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    etcd = _ClosedUnderCalls(failures=3)
    member = _reading(monkeypatch, etcd)
    with capture_logs() as logs:
        task = asyncio.get_running_loop().create_task(member._read_loop())
        await _until(lambda: etcd.reads > 3 or task.done())
        assert not task.done() and etcd.reads > 3, "the loop must go on after those rounds"
        task.cancel()  # a real cancel (stop) ends it
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
    failed = [e for e in logs if e["event"] == "cluster.registry_unreachable"]
    assert len(failed) == 1 and "read: CancelledError" in failed[0]["error"], failed


def _down(what: str, order: str) -> EtcdError:
    return EtcdError(order, "get_prefix", "dynamod/s/", f"no endpoint answered ({what})")


def _said(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["event"], e.get("error", "").split(": ")[0]) for e in logs]


def test_an_outage_is_said_once_a_loop_and_its_end_says_how_many_calls_failed() -> None:
    """Each loop warns at its first failed call, not at each (the endpoints' order turns
    from call to call, so each text differed: ~60 lines a daemon in cluster-ha.toml's ~7 s
    without etcd at its first start); a failure that is no etcd trouble (a bug) is said
    each time it reads otherwise; once every loop that failed went through again, one line
    says how many calls failed, and for how long, and the next outage is said again."""
    member = _membership()
    with capture_logs() as logs:
        for order in ("a,b,c", "b,c,a", "c,a,b"):
            for what in ("read", "watch", "publish"):
                member._failed(what, _down(what, order))
        member._failed("read", RuntimeError("a bug"))
        member._failed("read", RuntimeError("a bug"))  # the same text: once
        member._failed("read", RuntimeError("another bug"))
        member._reachable("keepalive")  # never failed: ends nothing
        member._reachable("publish")
        member._reachable("watch")
        member._failed("watch", _down("watch", "b,c,a"))  # flapping: said already
        assert member.error is not None and member._resync.is_set()
        member._reachable("watch")
        member._reachable("read")  # the last loop failing: the outage is over
        assert member.error is None
        member._failed("watch", _down("watch", "a,b,c"))
    assert _said(logs) == [
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 read"),
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 watch"),
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 publish"),
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 read"),
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 read"),
        ("cluster.registry_reachable", ""),
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 watch"),
    ], _said(logs)
    unexpected = [e["unexpected"] for e in logs if "unexpected" in e]
    assert unexpected == [False] * 3 + [True] * 2 + [False], unexpected
    back = logs[5]
    assert back["failed_calls"] == 13 and back["failing_s"] >= 0, back
    assert back["after"].endswith("watch)"), back


def test_a_loop_failing_alone_while_the_renewals_go_through_is_said_once() -> None:
    """The ledger watch refused at each try while the lease renews: one warning, no
    "reachable" at each renewal (it was two lines a renewal), the error stays in the view
    while that loop fails, and its own success ends it. Each renewal after a failure still
    reads the registry anew (a watch moved to a cut member is silent)."""
    member = _membership()
    with capture_logs() as logs:
        for _ in range(5):
            member._failed("ledger watch", _down("ledger watch", "a,b,c"))
            member._resync.clear()
            member._reachable("keepalive")
            assert member._resync.is_set(), "a renewal after a failure reads anew"
            member._reachable("publish")
            assert member.error is not None and "ledger watch" in member.error
        member._resync.clear()
        member._reachable("keepalive")
        assert not member._resync.is_set(), "no failure since the last renewal"
        member._reachable("ledger watch")
    assert _said(logs) == [
        ("cluster.registry_unreachable", "registry http://10.1.0.1:2379 ledger watch"),
        ("cluster.registry_reachable", ""),
    ], _said(logs)
    assert logs[1]["failed_calls"] == 5 and member.error is None, logs[1]


def test_the_watch_failing_alone_reads_anew_in_its_own_loop_not_at_each_renewal() -> None:
    """The watch loop reads the registry whole and watches it anew after its own failure,
    so a renewal after it adds no resync (it was one more whole read a renewal while the
    watch failed); another loop's failure still makes the next renewal read anew."""
    member = _membership()
    for _ in range(3):
        member._failed("watch", _down("watch", "a,b,c"))
        member._resync.clear()
        member._reachable("keepalive")
        member._reachable("publish")
        assert not member._resync.is_set(), "the watch's own failure: no renewal resync"
    member._failed("read", _down("read", "a,b,c"))
    member._reachable("publish")
    assert member._resync.is_set(), "another loop's failure: the renewal reads anew"


async def test_a_loop_that_ends_is_logged_and_started_again_until_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "LOOP_RESTART_S", 0.01)
    member = _membership()
    starts = 0

    async def dies_once() -> None:
        nonlocal starts
        starts += 1
        if starts == 1:
            raise RuntimeError("a bug")
        await asyncio.Event().wait()

    with capture_logs() as logs:
        member._spawn("cluster-test", dies_once)
        await _until(lambda: starts >= 2)
        await asyncio.sleep(0.05)  # and no third start
        assert starts == 2 and len(member._tasks) == 1 and not member._tasks[0].done()
        await member.stop()
        await asyncio.sleep(0.05)
    assert starts == 2 and not member._tasks
    ended = [e for e in logs if e["event"] == "cluster.loop_ended"]
    assert len(ended) == 1 and "a bug" in ended[0]["why"], ended


class _CancelsAsItAnswers:
    """Stands in for the etcd client: the read round is cancelled (stop) just as it
    answers, the moment Python 3.11's wait_for took for a round's end and lost the cancel."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.reads = 0

    async def get_prefix(self, prefix: str) -> list[Any]:
        self.reads += 1
        assert self.task is not None
        self.task.cancel()
        return []

    async def get_prefix_at(self, prefix: str) -> tuple[list[Any], int]:
        return await self.get_prefix(prefix), 1


async def test_a_stop_that_lands_as_a_round_ends_still_ends_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    etcd = _CancelsAsItAnswers()
    member = _reading(monkeypatch, etcd)
    task = asyncio.get_running_loop().create_task(member._read_loop())
    etcd.task = task
    done, _ = await asyncio.wait([task], timeout=1.0)
    assert done and task.cancelled(), f"the loop ran on after its cancel ({etcd.reads} reads)"
    assert etcd.reads == 1


async def test_the_control_wait_for_loses_that_cancel() -> None:
    """Why the loops use asyncio.timeout: the same round under wait_for, on this Python."""
    etcd = _CancelsAsItAnswers()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while rounds < 5:
            rounds += 1
            await asyncio.wait_for(etcd.get_prefix("p"), 8.0)
            await asyncio.sleep(0.01)

    task = asyncio.get_running_loop().create_task(loop())
    etcd.task = task
    await asyncio.wait([task], timeout=1.0)
    if sys.version_info >= (3, 12):
        pytest.skip("wait_for keeps the cancel from Python 3.12 on")
    assert rounds == 5 and not task.cancelled(), "3.11's wait_for returned the result"


async def test_stop_is_bounded_when_a_loop_will_not_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership, "STOP_GRACE_S", 0.2)
    member = _membership()
    done = False

    async def deaf() -> None:  # swallows every cancel, ends only when the test says so
        while not done:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    member._spawn("cluster-deaf", deaf)
    await asyncio.sleep(0.02)
    started = time.monotonic()
    with capture_logs() as logs:
        await member.stop()
    took = time.monotonic() - started
    done = True
    await asyncio.sleep(0.05)
    assert took < 1.0, took
    stuck = [e for e in logs if e["event"] == "cluster.loops_not_stopped"]
    assert stuck and stuck[0]["loops"] == ["cluster-deaf"], logs


def test_an_unchanged_entry_is_kept_by_the_keepalive_not_rewritten() -> None:
    """Each put wakes every node's registry watch into a read of the whole prefix: a node
    writes its entry once per lease, then only its keys that changed or that a read found
    not as written; a unit gone has its key deleted. Idle, it writes nothing."""
    must_write = membership.must_write
    e = {"h": "1", "u/a": "x", "u/b": "y"}
    at = {k: (v, 100) for k, v in e.items()}
    assert must_write(None, e, set()) == (e, [])  # nothing on this lease yet
    assert must_write(at, dict(e), set()) == ({}, [])  # a keepalive tick: unchanged
    assert must_write(at, {**e, "u/b": "z"}, set()) == ({"u/b": "z"}, [])
    assert must_write(at, {"h": "2", "u/a": "x"}, set()) == ({"h": "2"}, ["u/b"])
    assert must_write(at, dict(e), {"u/a"}) == ({"u/a": "x"}, [])  # a read found it gone


def test_a_read_finds_the_keys_lost_or_overwritten_some_other_way() -> None:
    def kv(key: str, value: str, lease: int = 7) -> KeyValue:
        return KeyValue(key, value.encode(), lease, 1)

    # each key's value and the store's revision after its put
    written = {"h": ("1", 100), "u/a": ("x", 100), "u/b": ("y", 100), "u/c": ("z", 105)}
    intact = [kv("h", "1"), kv("u/a", "x"), kv("u/b", "y"), kv("u/c", "z"), kv("other", "q")]
    assert membership.not_as_written(written, intact, 7, revision=106) == set()
    broken = [kv("h", "1"), kv("u/a", "X"), kv("u/b", "y", lease=8)]  # u/c gone
    assert membership.not_as_written(written, broken, 7, revision=105) == {"u/a", "u/b", "u/c"}
    # a view older than a put may not show it yet: that key is not judged
    assert membership.not_as_written(written, broken, 7, revision=104) == {"u/a", "u/b"}


class _Ledger:
    """Stands in for the policy manager: the ledger's watch yields one change after each of
    `moves` s (then stays open; `broken`: it fails at once instead); follow_ledger records
    when it was called, and whether the policy lock was held then."""

    def __init__(self, moves: tuple[float, ...] = (), broken: bool = False) -> None:
        self.moves, self.broken = moves, broken
        self.follows: list[float] = []
        self.given: list[bool] = []  # per look: whether it was handed the watch's read
        self.watched_from: list[int | None] = []
        self.spec = SimpleNamespace(store="etcd")
        self.lock = asyncio.Lock()

    async def ledger_read(self) -> tuple[None, int]:
        return None, 41

    async def _changes(self) -> Any:
        if self.broken:
            raise EtcdError("http://127.0.0.1:1", "watch_prefix", "policy/current", "refused")
        for after in self.moves:
            await asyncio.sleep(after)
            yield object()
        await asyncio.sleep(3600)

    def ledger_changes(self, start_revision: int | None = None) -> Any:
        self.watched_from.append(start_revision)
        return self._changes()

    async def follow_ledger(self, read: tuple[None] | None = None) -> int:
        self.follows.append(time.monotonic())
        self.given.append(read is not None)
        return 1


async def _following(ledger: _Ledger, seconds: float) -> float:
    """The watch and follow loops of a member whose policy is `ledger`, for `seconds`;
    returns when they started (monotonic)."""
    member = Membership(SPEC, registrations=Any, policy=ledger)  # type: ignore[arg-type]
    member.host = SimpleNamespace(phase=Phase.UP)  # type: ignore[assignment]
    started = time.monotonic()
    tasks = [asyncio.create_task(member._ledger_watch_loop()),
             asyncio.create_task(member._follow_loop())]  # fmt: skip
    try:
        await asyncio.sleep(seconds)
    finally:
        member._stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return started


async def test_another_nodes_push_is_followed_when_the_ledger_moves_not_at_the_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "LEDGER_FOLLOW_S", 30.0)  # the poll alone: 30 s
    ledger = _Ledger(moves=(0.2,))
    started = await _following(ledger, 0.6)
    assert ledger.watched_from == [42], "the watch starts after the revision read"
    # one look as the watch opens (what it will not carry), one at the move
    assert len(ledger.follows) == 2, ledger.follows
    assert ledger.follows[0] - started < 0.1
    assert 0.2 <= ledger.follows[1] - started < 0.5
    # the look as it opens is handed the read the watch started from (no second read);
    # the look at the move reads the ledger anew
    assert ledger.given == [True, False]


async def test_with_the_watch_open_the_follower_does_not_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "LEDGER_FOLLOW_S", 0.05)
    monkeypatch.setattr(membership, "RESYNC_S", 0.6)  # the watch opened again, and a look
    ledger = _Ledger()
    await _following(ledger, 1.0)
    assert len(ledger.follows) == 2, ledger.follows  # at 0 and at 0.6 s, not every 0.05 s
    assert ledger.watched_from == [42, 42]
    assert ledger.given == [True, True]  # each on the read its watch started from


async def test_without_a_watch_the_follower_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership, "LEDGER_FOLLOW_S", 0.05)
    monkeypatch.setattr(membership, "WATCH_RETRY_S", 10.0)
    ledger = _Ledger(broken=True)
    await _following(ledger, 0.5)
    assert len(ledger.follows) >= 6, ledger.follows


async def test_a_look_while_a_push_here_holds_the_lock_is_tried_again_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership, "LEDGER_FOLLOW_S", 0.05)
    ledger = _Ledger(moves=(0.1,))

    async def push_here() -> None:  # holds the lock over the move, then lets go
        async with ledger.lock:
            await asyncio.sleep(0.3)

    pushing = asyncio.create_task(push_here())
    started = await _following(ledger, 0.6)
    await pushing
    assert ledger.follows, "the follower never looked after the lock was let go"
    assert 0.3 <= ledger.follows[0] - started < 0.45, ledger.follows
    assert ledger.given[0] is False, "a look put off by the lock used a read from before it"


def test_a_failed_publish_round_is_tried_again_soon_then_backs_off_to_the_period() -> None:
    period = 2.0 / 3  # the stock 2 s lease
    waits = [membership.publish_wait(n, period) for n in range(6)]
    assert waits[0] == period  # after a success
    assert waits[1:4] == [0.1, 0.2, 0.4]
    assert waits[4:] == [period, period]  # never slower than the period
    # the keepalive that failed after a silent member's quarter-lease wait is retried in
    # time: a success, a period, a failed round of a quarter lease, then the retry
    assert period + 2.0 / 4 + waits[1] < 2.0 - 0.5
    assert membership.publish_wait(10_000, period) == period  # no overflow after a long outage


class _Registry:
    """Stands in for the etcd client at the registry prefix: the entries it holds now
    (this daemon already the leader); get_prefix_at answers them."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes

    async def get_prefix_at(self, prefix: str) -> tuple[list[Any], int]:
        rows = [SimpleNamespace(key=k, value=v.encode())
                for n in self.nodes for k, v in _entry(n).records("s").items()]  # fmt: skip
        return [*rows, SimpleNamespace(key=f"{prefix}leader", value=b"head")], 1


def _entry(node: str) -> Any:
    from dynamod.cluster.registry import NodeEntry, UnitEntry

    worker = UnitEntry("worker@0", "worker", "ready", 42, {}, "ok", 1, [0xAB], shard=True)
    return NodeEntry(node, "10.1.0.1", 100, "run", "up", node == "head", [worker], 1)


async def test_an_entry_that_vanished_while_the_leader_itself_failed_is_judged_a_lease_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI: the head's etcd member, the etcd leader, killed on a loaded machine; the other two
    answered nobody for ~4.5 s, every node's lease expired, and the first daemon back (the
    cluster's leader, its own lease expired too) marked the others lost as it read their
    entries gone: their shards withdrawn, a push answered without them. The leader judges
    only once its own registry calls have gone through for a whole lease (2 s here)."""
    spec = ClusterSpec(nodes={"head": "10.1.0.1", "n1": "10.1.0.2", "n2": "10.1.0.3"},
                       head="head", node="head", lease_ttl=2,
                       registry=["http://10.1.0.1:2379"])  # fmt: skip
    member = Membership(spec, registrations=Any, policy=None)  # type: ignore[arg-type]
    member.host = SimpleNamespace(stack=SimpleNamespace(name="s"), phase=Phase.UP)  # type: ignore[assignment]
    etcd = _Registry(["head", "n1", "n2"])
    member.etcd = etcd  # type: ignore[assignment]
    marked: list[str] = []

    async def mark_lost(name: str, entry: Any) -> None:
        marked.append(name)

    monkeypatch.setattr(member, "_mark_lost", mark_lost)
    clock = [1000.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: clock[0])
    await member.read()
    assert member.leader == "head" and set(member.entries) == {"head", "n1", "n2"}

    member._failed("publish", TimeoutError("no answer"))  # the outage, seen by the leader
    etcd.nodes = ["head"]  # n1's and n2's leases expired with it
    with capture_logs() as logs:
        clock[0] += 1.9  # back in contact for less than a lease
        await member.read()
        await member.read()
    assert marked == []
    deferred = [e["node"] for e in logs if e["event"] == "cluster.node_loss_deferred"]
    assert deferred == ["n1", "n2"], logs  # logged once each

    etcd.nodes = ["head", "n1"]  # n1 got through again and put its entry back
    with capture_logs() as logs:
        clock[0] += 0.2  # a whole lease in contact: n2, still gone, is judged lost
        await member.read()
    assert marked == ["n2"]
    assert [e["node"] for e in logs if e["event"] == "cluster.node_back_before_judged"] == ["n1"]

    etcd.nodes = ["head"]  # a node gone while the leader is in contact: marked at once
    await member.read()
    assert marked == ["n2", "n1"]


def test_the_leader_judges_a_vanished_entry_only_after_a_lease_of_its_own_contact() -> None:
    from dynamod.cluster import registry

    assert registry.may_judge(None, 5.0, lease_ttl=2)  # never failed
    assert not registry.may_judge(100.0, 101.99, lease_ttl=2)
    assert registry.may_judge(100.0, 102.0, lease_ttl=2)


class _Leases:
    """Stands in for the etcd client's lease calls: keepalives answer the TTL (None once
    `gone`), and each is timed."""

    def __init__(self) -> None:
        self.renewals: list[float] = []
        self.gone = False

    async def lease_keepalive(self, lease: int) -> int | None:
        self.renewals.append(time.monotonic())
        return None if self.gone else 1


async def test_the_lease_is_kept_alive_while_a_publish_round_is_stuck() -> None:
    """A publish round may take seconds (an entry write on a loaded etcd, or putting back
    every shard's registration after a loss); the lease's keepalive does not wait for it:
    at 4 nodes x 32 shards, keepalives behind such rounds let the head's lease expire
    again and again."""
    member = Membership(SPEC.model_copy(update={"lease_ttl": 1.0}), registrations=Any,  # type: ignore[arg-type]
                        policy=None)  # fmt: skip
    etcd = _Leases()
    member.etcd, member.lease = etcd, 7  # type: ignore[assignment]
    rounds = 0

    async def stuck() -> None:  # one publish round that never ends (8 s would cut it)
        nonlocal rounds
        rounds += 1
        await asyncio.sleep(3600)

    member._publish = stuck  # type: ignore[method-assign]
    tasks = [asyncio.create_task(loop()) for loop in (member._publish_loop, member._keepalive_loop)]
    try:
        await asyncio.sleep(1.5)
        assert rounds == 1, "the publish round is still the first one"
        assert len(etcd.renewals) >= 4, etcd.renewals  # every third of the 1 s lease
        gaps = [b - a for a, b in itertools.pairwise(etcd.renewals)]
        assert max(gaps) < 0.5, gaps
        # etcd's answer that the lease is gone: the next publish round takes a new one
        etcd.gone = True
        await _until(lambda: member.lease is None)
        assert member.lease is None and member._lease_gone and member._dirty.is_set()
    finally:
        member._stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Watched:
    """Stands in for the etcd client at the registry prefix: each read of the prefix is
    timed and answers what the test put in `kvs`, at `revision`; a watch yields the
    events the test queues (an exception queued breaks it), and records where it began."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.reads: list[float] = []
        self.kvs: list[KeyValue] = []
        self.revision = 10
        self.watched_from: list[int | None] = []

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Any:
        self.watched_from.append(start_revision)
        while True:
            item = await self.events.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    async def get_prefix_at(self, prefix: str) -> tuple[list[KeyValue], int]:
        self.reads.append(time.monotonic())
        return list(self.kvs), self.revision


def _event(kind: str, key: str, revision: int, value: bytes = b"v") -> WatchEvent:
    put = kind == "put"
    return WatchEvent(kind, key, value if put else b"", revision, 7 if put else 0)  # type: ignore[arg-type]


async def test_the_watch_keeps_a_copy_looked_at_every_gap_and_a_delete_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every read is the whole registry (~260 KB at 8 x 32). It is read once and then
    kept by the watch from the revision after that read: on a stream of entry writes the
    daemon reads etcd no more, and looks at its copy at most every MIRROR_GAP_S, not
    back to back; a delete (a node's lease expired) is looked at at once."""
    etcd = _Watched()
    etcd.kvs = [KeyValue("s/k", b"old", 7, 9)]
    member = _reading(monkeypatch, etcd)
    monkeypatch.setattr(membership, "READ_FALLBACK_S", 5.0)
    monkeypatch.setattr(membership, "MIRROR_GAP_S", 0.3)
    looks: list[float] = []
    parse = membership.registry.parse

    def counted(*args: Any) -> Any:
        looks.append(time.monotonic())
        return parse(*args)

    monkeypatch.setattr(membership.registry, "parse", counted)
    tasks = [asyncio.create_task(member._watch_loop()), asyncio.create_task(member._read_loop())]
    try:
        await _until(lambda: member._mirror is not None and len(looks) >= 1)
        assert etcd.watched_from == [11]
        first = len(looks)
        for revision in range(11, 71):  # 1.2 s of writes, one every 20 ms
            etcd.events.put_nowait(_event("put", "s/k", revision, f"v{revision}".encode()))
            await asyncio.sleep(0.02)
        assert len(etcd.reads) == 1, "a put was read from etcd, not from the copy"
        gaps = [b - a for a, b in itertools.pairwise(looks[first:])]
        assert 3 <= len(looks) - first <= 6 and min(gaps) >= 0.29, gaps
        await _until(lambda: time.monotonic() - looks[-1] > 0.1)
        assert member._mirror is not None and member._mirror.kvs["s/k"].value == b"v70"
        seen = len(looks)
        etcd.events.put_nowait(_event("put", "s/k", 71))
        await asyncio.sleep(0.05)
        deleted = time.monotonic()
        etcd.events.put_nowait(_event("delete", "s/k", 72))
        await _until(lambda: len(looks) > seen)
        assert looks[-1] - deleted < 0.1, looks[-1] - deleted
        assert "s/k" not in member._mirror.kvs and member._mirror.revision == 72
    finally:
        member._stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_planned_resync_reads_the_registry_once_and_the_copy_serves_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every RESYNC_S the copy is read whole again while its watch is healthy: one read of
    etcd each time (the new copy's), the old copy serving the reader until it is replaced;
    it once went at each resync for WATCH_RETRY_S, the reader reading the whole registry
    from etcd meanwhile."""
    etcd = _Watched()
    etcd.kvs = [KeyValue("s/k", b"v", 7, 9)]
    member = _reading(monkeypatch, etcd)
    monkeypatch.setattr(membership, "RESYNC_S", 0.25)
    monkeypatch.setattr(membership, "MIRROR_GAP_S", 0.01)
    tasks = [asyncio.create_task(member._watch_loop()), asyncio.create_task(member._read_loop())]
    try:
        await _until(lambda: member._mirror is not None)
        without: list[float] = []
        ends = time.monotonic() + 1.2
        while time.monotonic() < ends:
            etcd.revision += 1
            if member._mirror is None:
                without.append(time.monotonic())
            await asyncio.sleep(0.005)
        assert not without, f"the reader was left without the copy {len(without)} times"
        assert len(etcd.reads) == len(etcd.watched_from), (etcd.reads, etcd.watched_from)
        assert len(etcd.watched_from) >= 4, etcd.watched_from  # four resyncs or more
        assert member.entries == {} and member.error is None
    finally:
        member._stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_broken_watch_or_a_failed_keepalive_reads_the_registry_whole_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy goes the moment its watch breaks (the reader reads etcd meanwhile), and a
    new read and a watch from the revision after it take over; a keepalive that failed
    (this daemon out of contact: its watch may be silent without an error) does the
    same."""
    etcd = _Watched()
    member = _reading(monkeypatch, etcd)
    monkeypatch.setattr(membership, "WATCH_RETRY_S", 0.05)
    task = asyncio.create_task(member._watch_loop())
    try:
        await _until(lambda: member._mirror is not None)
        etcd.revision = 20
        etcd.events.put_nowait(OSError("stream reset"))
        await _until(lambda: etcd.watched_from == [11, 21])
        assert len(etcd.reads) == 2 and member._mirror is not None
        assert member._mirror.loaded_at == 20
        etcd.revision = 30
        member._failed("keepalive", TimeoutError("no answer"))
        await _until(lambda: etcd.watched_from == [11, 21, 31])
        assert len(etcd.reads) == 3
        member._failed("watch", TimeoutError("no answer"))  # its own failures: no resync
        await asyncio.sleep(0.2)
        assert len(etcd.reads) == 3
    finally:
        member._stopping = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_waiting_push_looks_at_the_watch_s_copy_sooner_and_etcd_is_never_read_faster(
) -> None:
    """The gap between reads after a put: etcd's own reads stay 0.5 s apart whatever
    waits; the watch's copy is looked at every 0.1 s, and every 0.02 s in the first second
    of a push's or a publish's wait for the other nodes' entries (a 2-node publish
    answered ~100 ms after the other node held the step)."""
    member = _membership()
    assert member._read_gap() == membership.READ_GAP_S == 0.5  # no copy: etcd is read
    member._awaiting, member._awaited_until = 1, time.monotonic() + 1.0
    assert member._read_gap() == membership.READ_GAP_S
    member._mirror = object()  # type: ignore[assignment]
    assert member._read_gap() == membership.AWAITED_GAP_S == 0.02
    member._awaited_until = time.monotonic() - 0.001  # a wait of more than a second
    assert member._read_gap() == membership.MIRROR_GAP_S == 0.1
    member._awaiting, member._awaited_until = 0, time.monotonic() + 1.0
    assert member._read_gap() == membership.MIRROR_GAP_S


async def test_a_push_s_wait_on_the_other_nodes_is_counted_while_it_lasts() -> None:
    member = _membership()
    member.policy = SimpleNamespace(spec=SimpleNamespace(route_timeout=5.0))  # type: ignore[assignment]
    before = time.monotonic()
    answer = await member.await_other_nodes(3)  # no other node: nothing to wait for
    assert answer["behind"] == [] and member._awaiting == 0
    assert member._awaited_until >= before + membership.AWAITED_FOR_S
