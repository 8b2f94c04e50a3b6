"""Pauses of a shard made outside dynamod, claimed by the process that makes them.

verl pauses shards itself: a trainer rank before it sends a shard the step's weights over
IPC (`pause_generation`, mode keep), and a rollout server for a whole training step
(`abort_all_requests`). Each claims the pause first, through its node's control socket,
so dynamod knows who holds which shard paused, since when and why (`status` shows it),
until dynamod resumes the shard (the publish that admits the step, a replay) or the
claimer releases it (verl's `resume_generation`).

The claimer is the process at the other end of the socket (SO_PEERCRED, not a pid it
says), watched by a pidfd. One that exits with a claim still open leaves a shard paused
that nobody will resume, its weights maybe half sent: each such shard goes to
`on_orphaned`, and the policy manager rejoins it (held out of routing, the ledger's
version replayed, its KV cache reset, verified, resumed). Pure bookkeeping here; the
event loop only watches the pidfds.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from aiohttp import web

from dynamod.core.api import peer_pid
from dynamod.core.errors import DynamodError
from dynamod.core.status import PauseClaimStatus

log = structlog.get_logger("dynamod.rollout.pause_claims")


class ClaimError(DynamodError):
    """A pause claim that cannot be taken: its claimer cannot be watched."""


@dataclass(frozen=True)
class Claim:
    pid: int
    why: str
    since: float  # time.monotonic()


BODY = 'expected a JSON body {"shards": ["worker@0", ...], "why": "..."}'


def parse_body(
    body: object, known: Iterable[str], *, claiming: bool
) -> tuple[list[str] | None, str]:
    """A claim's or release's shards (None: every one of the caller's, for a release only)
    and why (cut to 200 characters); a shard not of this node is refused, named."""
    if not isinstance(body, dict):
        raise DynamodError(BODY)
    shards, why = body.get("shards"), body.get("why", "")
    listed = isinstance(shards, list) and all(isinstance(s, str) for s in shards)
    if not isinstance(why, str) or not (listed or (shards is None and not claiming)):
        raise DynamodError(BODY)
    unknown = sorted(set(shards or []) - set(known))
    if unknown:
        raise DynamodError(f"not a rollout shard of this node: {', '.join(unknown)}")
    return shards, why[:200]


class PauseClaims:
    def __init__(self, on_orphaned: Callable[[str, Claim], None]) -> None:
        self.on_orphaned = on_orphaned
        self._claims: dict[str, dict[int, Claim]] = {}  # shard -> claimer pid -> claim
        self._watched: dict[int, int] = {}  # claimer pid -> its pidfd

    def claim(self, pid: int, shards: Iterable[str], why: str) -> list[str]:
        """`pid` holds `shards` paused (a claim it made before is renewed)."""
        names = sorted(set(shards))
        if not names:
            return []
        self._watch(pid)
        now = time.monotonic()
        for shard in names:
            self._claims.setdefault(shard, {})[pid] = Claim(pid, why, now)
        log.info("policy.pause_claimed", pid=pid, shards=names, why=why)
        return names

    def release(self, pid: int, shards: Iterable[str] | None = None) -> list[str]:
        """`pid`'s claims on `shards` (all of them: None) end; the shards they were on."""
        wanted = None if shards is None else set(shards)
        released = []
        for shard in list(self._claims):
            if (wanted is None or shard in wanted) and self._drop(shard, pid) is not None:
                released.append(shard)
        self._unwatch_idle()
        if released:
            log.info("policy.pause_released", pid=pid, shards=released)
        return released

    def ended(self, shard: str) -> None:
        """dynamod resumed `shard`, or it exited: no claim on it holds any more."""
        if self._claims.pop(shard, None):
            self._unwatch_idle()

    def of(self, shard: str) -> list[PauseClaimStatus]:
        now = time.monotonic()
        return [
            {"pid": c.pid, "why": c.why, "for_s": round(now - c.since, 1)}
            for c in self._claims.get(shard, {}).values()
        ]

    def claimed(self) -> list[str]:
        return sorted(self._claims)

    def routes(self, known: Callable[[], Iterable[str]]) -> list[web.RouteDef]:
        """POST /policy/pause {"shards": [...], "why": "..."}: the caller holds them paused;
        POST /policy/release {"shards": [...]} (all the caller's: no "shards"): it no
        longer does. `known`: this node's shards."""

        async def body_of(request: web.Request, *, claiming: bool) -> tuple[list[str] | None, str]:
            try:
                body = await request.json()
            except ValueError:
                body = None
            return parse_body(body, known(), claiming=claiming)

        def caller(request: web.Request) -> int:
            pid = peer_pid(request)
            if pid is None:
                raise ClaimError("the calling process cannot be seen from this daemon (another "
                                 "pid namespace): its pause cannot be watched; run dynamod on "
                                 "the host or in the caller's pid namespace")  # fmt: skip
            return pid

        async def pause(request: web.Request) -> web.Response:
            shards, why = await body_of(request, claiming=True)
            pid = caller(request)
            return web.json_response({"pid": pid, "claimed": self.claim(pid, shards or [], why)})

        async def release(request: web.Request) -> web.Response:
            shards, _ = await body_of(request, claiming=False)
            pid = caller(request)
            return web.json_response({"pid": pid, "released": self.release(pid, shards)})

        return [web.post("/policy/pause", pause), web.post("/policy/release", release)]

    def close(self) -> None:
        for pid in list(self._watched):
            self._unwatch(pid)
        self._claims.clear()

    def _drop(self, shard: str, pid: int) -> Claim | None:
        claims = self._claims.get(shard, {})
        claim = claims.pop(pid, None)
        if not claims:
            self._claims.pop(shard, None)
        return claim

    def _watch(self, pid: int) -> None:
        if pid in self._watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ClaimError(f"process {pid} is gone: nothing to hold the pause") from None
        except OSError as exc:
            raise ClaimError(f"cannot watch process {pid} (pidfd_open: {exc})") from None
        asyncio.get_running_loop().add_reader(fd, self._gone, pid)
        self._watched[pid] = fd

    def _unwatch(self, pid: int) -> None:
        fd = self._watched.pop(pid)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _unwatch_idle(self) -> None:
        holding = {pid for claims in self._claims.values() for pid in claims}
        for pid in set(self._watched) - holding:
            self._unwatch(pid)

    def _gone(self, pid: int) -> None:
        """The claimer exited: its shards still claimed are orphans."""
        self._unwatch(pid)
        for shard in list(self._claims):
            claim = self._drop(shard, pid)
            if claim is not None:
                log.warning("policy.pause_orphaned", shard=shard, pid=pid, why=claim.why,
                            held_s=round(time.monotonic() - claim.since, 1))  # fmt: skip
                self.on_orphaned(shard, claim)
