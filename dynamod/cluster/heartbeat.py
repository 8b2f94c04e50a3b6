"""Node heartbeats: the leader hears every other node's daemon five times a second over
UDP, so a node cut off from the network leaves routing before its registry lease runs out.

The registry lease (`lease_ttl`, 2 s in the stock stacks) marks a node lost when etcd
deletes its entry at the lease's expiry: 1.3-2.5 s after a cut, since the last renewal came
up to a third of the lease before it and etcd revokes expired leases every 0.5 s. With
`heartbeat_timeout` (seconds; 0 turns it off) the leader also sends each node a datagram
every PING_S, which that node's daemon echoes from a thread of its own (`Responder`: an
event loop busy for a second does not silence it). A node that answered before and has
not answered for `heartbeat_timeout` has its registry lease revoked by the leader
(cluster/membership.py), which is then the same loss as an expiry: its entry deleted, its
shards' registrations parked, put back when it is in contact again. The leader itself is
pinged by the deputy, the first of the other nodes by name, which revokes a silent
leader's lease the same way and takes the leader key (cluster/membership.py
`_heard_by_me`, `_revoke_silent`).

It can only make a loss earlier: a node whose answers come but whose lease expires is lost
as before. Where its own evidence is weak, it stays out and the lease decides (`judge`):
- a node is judged only once it has answered (a port a firewall blocks: lease only);
- a node judged silent is not judged again until it answers again (a node the leader
  cannot hear but etcd can is parked once, not again at each return);
- the pinging daemon's own pinger must have run throughout the window (a starved daemon
  hears nobody);
- when more than half of three or more nodes are silent at once, none is judged: it is
  more likely the pinging daemon that is cut off.

A datagram is MAGIC, the stack's name, the node's name and a sequence number, echoed as
it came (the same size back: nothing to amplify); an answer counts only for the node it
was sent to, with a sequence number of the last ANSWER_WINDOW rounds.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"dynamod-heartbeat-1"
PING_S = 0.2  # the leader pings every node this often
MAX_DATAGRAM = 512
# a gap this long between two of the pinger's rounds (two missed) says its thread was
# starved: no node is judged on a window that holds one
STARVED_GAP_S = 2.5 * PING_S
# Nodes whose silence is within this of the timeout count as silent "at once" with those
# past it (two rounds: one round's answers split, or one datagram lost)
AT_ONCE_S = 2 * PING_S
ANSWER_WINDOW = 25  # rounds (5 s): an answer to an older ping is not counted
# a ping after this long without one: this node hears the cluster again (its link is back)
BACK_AFTER_S = 5 * PING_S
_RECV_TIMEOUT_S = 0.5  # a thread looks at its stop flag at least this often
_JOIN_S = 1.0


def datagram(stack: str, node: str, sequence: int) -> bytes:
    return b"\0".join((MAGIC, stack.encode(), node.encode(), str(sequence).encode()))


def parse(data: bytes) -> tuple[str, str, int] | None:
    """(stack, node, sequence) of a heartbeat datagram, None for anything else."""
    parts = data.split(b"\0")
    if len(parts) != 4 or parts[0] != MAGIC or not parts[3].isdigit():
        return None
    try:
        return parts[1].decode(), parts[2].decode(), int(parts[3])
    except UnicodeDecodeError:
        return None


class Responder:
    """Echoes heartbeats on (address, a port of its own) from a thread of its own. `back_at`:
    when the first ping came after BACK_AFTER_S without one (monotonic; None before any),
    which tells a node whose link was cut that it is back."""

    def __init__(self, address: str) -> None:
        try:
            family, _, _, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_DGRAM)[0]
        except IndexError:
            raise OSError(f"{address}: no address to bind") from None
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._sock.bind(where)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(_RECV_TIMEOUT_S)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self.back_at: float | None = None
        self._pinged_at: float | None = None
        self._thread = threading.Thread(target=self._serve, name="dynamod-heartbeat",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self._stop.is_set():
                return  # closing: no answer after it
            if parse(data) is not None:
                now = time.monotonic()
                if self._pinged_at is None or now - self._pinged_at >= BACK_AFTER_S:
                    self.back_at = now
                self._pinged_at = now
                with contextlib.suppress(OSError):
                    self._sock.sendto(data, peer)

    def close(self) -> None:
        """Stop answering at once, then let the thread go (a datagram of its own wakes it
        from its wait) and close the socket."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.sendto(b"", self._sock.getsockname())
        self._thread.join(_JOIN_S)
        self._sock.close()


@dataclass(frozen=True)
class Heard:
    """What the pinger knew at `now` (monotonic): each node's last answer, and when its own
    rounds of pings went out (the newest last)."""

    now: float
    answered: dict[str, float] = field(default_factory=dict)
    rounds: tuple[float, ...] = ()


class Pinger:
    """The pinging side (the leader; the deputy, for the leader): pings each node it is
    aimed at every `interval` s and records when each last answered, from a thread of its
    own."""

    def __init__(self, stack: str, interval: float = PING_S) -> None:
        self.stack, self.interval = stack, interval
        self._lock = threading.Lock()
        self._targets: dict[str, tuple[str, int]] = {}
        self._answered: dict[str, float] = {}
        self._rounds: deque[float] = deque(maxlen=4 * ANSWER_WINDOW)
        self._sequence = 0
        self._sockets: dict[socket.AddressFamily, socket.socket] = {}
        self._resolved: dict[tuple[str, int], tuple[socket.AddressFamily, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynamod-pinger", daemon=True)
        self._thread.start()

    def aim(self, targets: Mapping[str, tuple[str, int]]) -> None:
        """Ping these nodes (name -> (address, port)) from now on. A node whose address or
        port changed (a new daemon) must answer again before it counts as heard."""
        with self._lock:
            for name, target in self._targets.items():
                if targets.get(name) != target:
                    self._answered.pop(name, None)
            self._targets = dict(targets)

    def heard(self) -> Heard:
        with self._lock:
            return Heard(time.monotonic(), dict(self._answered), tuple(self._rounds))

    def _socket(self, family: socket.AddressFamily) -> socket.socket:
        sock = self._sockets.get(family)
        if sock is None:
            sock = self._sockets[family] = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
        return sock

    def _resolve(self, address: str, port: int) -> tuple[socket.AddressFamily, Any] | None:
        """Where a node's (address, port) is, looked up once (a node's address may be a
        name; this thread may wait on the lookup, the daemon's loop never does)."""
        key = (address, port)
        if key not in self._resolved:
            try:
                info = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
            except (OSError, IndexError):
                return None  # not now: never heard, so never judged on it
            self._resolved[key] = (info[0], info[4])
        return self._resolved[key]

    def _send_round(self) -> None:
        with self._lock:
            self._sequence += 1
            sequence, targets = self._sequence, dict(self._targets)
            self._rounds.append(time.monotonic())
        for name, (address, port) in targets.items():
            where = self._resolve(address, port)
            if where is None:
                continue
            with contextlib.suppress(OSError):  # unreachable now: silence says so
                self._socket(where[0]).sendto(datagram(self.stack, name, sequence), where[1])

    def _receive(self, sock: socket.socket) -> None:
        while True:
            try:
                data, _ = sock.recvfrom(MAX_DATAGRAM)
            except OSError:  # none left (BlockingIOError), an ICMP error, or closed
                return
            got = parse(data)
            if got is None:
                continue
            stack, name, sequence = got
            with self._lock:
                fresh = self._sequence - ANSWER_WINDOW < sequence <= self._sequence
                if stack == self.stack and name in self._targets and fresh:
                    self._answered[name] = time.monotonic()

    def _run(self) -> None:
        next_round = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_round:
                self._send_round()
                next_round = now + self.interval
            sockets = list(self._sockets.values())
            wait = max(0.0, min(next_round - time.monotonic(), _RECV_TIMEOUT_S))
            if not sockets:
                self._stop.wait(wait)
                continue
            with contextlib.suppress(OSError, ValueError):
                readable, _, _ = select.select(sockets, [], [], wait)
                for sock in readable:
                    self._receive(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(_JOIN_S)
        for sock in self._sockets.values():
            sock.close()


def largest_gap(rounds: tuple[float, ...], now: float, window: float) -> float:
    """The longest time the pinger's rounds left uncovered in the last `window` s (its
    start counts as a gap where the rounds began inside the window)."""
    start = now - window
    times = [t for t in rounds if t >= start - STARVED_GAP_S] + [now]
    if times[0] > start:  # none before the window: its start is where the gap begins
        times.insert(0, start)
    return max(b - a for a, b in itertools.pairwise(times))


@dataclass(frozen=True)
class Judgment:
    """The nodes to mark lost, and the armed nodes silent for the timeout that are not
    (`overdue`), with why (`withheld`)."""

    lost: list[str]
    overdue: list[str]
    withheld: str = ""


def silent_for(heard: Heard, armed: AbstractSet[str], seconds: float) -> list[str]:
    """The nodes of `armed` that answered once and not for `seconds`, sorted."""
    answered = heard.answered
    return sorted(n for n in armed if n in answered and heard.now - answered[n] >= seconds)


def judge(heard: Heard, armed: AbstractSet[str], timeout: float) -> Judgment:
    """The nodes of `armed` to mark lost: each answered once and not for `timeout` s.
    None while the pinger did not run throughout (a gap over STARVED_GAP_S), or when more
    than half of three or more armed nodes are silent at once, counting those within
    AT_ONCE_S of the timeout (the pinging daemon's own link is the likelier fault)."""
    overdue = silent_for(heard, armed, timeout)
    if not overdue:
        return Judgment([], [])
    gap = largest_gap(heard.rounds, heard.now, timeout)
    if gap > STARVED_GAP_S:
        return Judgment([], overdue, f"this daemon's pings stopped for {gap:.2f}s meanwhile")
    # "at once" counts the nodes near the timeout too: a link cut at the pinging daemon
    # silences every node within a round or two, and the first overdue alone was judged
    # while the next was 0.07 s short of it (CI, 2 of 3 silenced together, both revoked)
    near = silent_for(heard, armed, max(timeout - AT_ONCE_S, timeout / 2))
    if len(armed) >= 3 and 2 * len(near) > len(armed):
        at_once = f"{len(near)} of {len(armed)} nodes silent at once"
        return Judgment([], overdue, f"{at_once}: this daemon's own link is the likelier fault")
    return Judgment(overdue, [])


@dataclass
class Hearing:
    """A daemon's side of the heartbeats: its echo; as the leader, its pinger, the nodes it
    judged silent (node -> when: not judged again before they answer again), and why a
    node whose lease it revoked was lost."""

    responder: Responder | None = None
    pinger: Pinger | None = None
    silenced: dict[str, float] = field(default_factory=dict)
    why_lost: dict[str, str] = field(default_factory=dict)
    withheld: set[str] = field(default_factory=set)  # silent, not judged: logged once
    waiting: set[str] = field(default_factory=set)  # judged, its revocation failed: logged once

    def stop_pinging(self) -> None:
        if self.pinger is not None:
            self.pinger.close()
            self.pinger = None

    def close(self) -> None:
        self.stop_pinging()
        if self.responder is not None:
            self.responder.close()
            self.responder = None
