"""Hot spare shards: K extra shard instances that run, are ready and hold the ledger's
version, but carry no policy taint (so no trainer traffic reaches them) and do not count
as admitted. When a serving shard dies (seen as it starts dying, before the kernel has
torn it down), is declared lost (its liveness failed past the threshold) or fails
verification, a spare is promoted at once (woken if asleep, replayed if behind, verified,
tainted, and serving only once a canary through the frontend reaches it), and the
instance it replaces becomes a spare once it is back. After every push or publish the
spares are replayed in the background, off the trainer's critical path. Spares may sleep
(`control/sleep` level 1) and are woken on promotion. Roles are assigned when a shard
turns ready: the first instances fill the serving count, the rest are spares.

A live change (`dynamod apply`, `scale`) re-reads the count: before it removes shards, a
spare that stays is promoted for every serving shard the stack would otherwise be short of
(so the spare role is what goes, not a serving shard); once the stack is adopted, spares are
promoted or the last serving shards in start order become spares until `[policy] spares`
holds again, and an added instance takes the role the new count gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from dynamod.core.deathwatch import DeathWatch
from dynamod.core.errors import DynamodError
from dynamod.core.restart import Exit
from dynamod.core.status import ExtensionUnitStatus, SpareStatus
from dynamod.rollout.shard_driver import ShardAck

if TYPE_CHECKING:
    from dynamod.core.engine import Unit
    from dynamod.rollout.shard_driver import ShardDriver

log = structlog.get_logger("dynamod.rollout.spares")


class Role(StrEnum):
    SERVING = "serving"  # taken into service: tainted with the current version, admitted
    SPARE = "spare"  # ready at (or catching up to) the current version, untainted
    PROMOTING = "promoting"  # a spare being taken into service (wake, replay, taint)


class Reason(StrEnum):
    """Why a spare was promoted (the `reason` label of the promotions metric)."""

    EXIT = "exit"  # the serving shard's process exited (or started dying)
    VERIFICATION = "verification"  # the serving shard failed a push or publish
    LOST = "lost"  # the serving shard was declared lost: alive, but its liveness failed
    APPLY = "apply"  # `dynamod apply` / `scale` changed how many shards serve


@dataclass
class Slot:
    """One running shard instance's role. `lock` serialises its replays and promotion."""

    role: Role
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    asleep: bool = False
    keeper: asyncio.Task[None] | None = None
    dirty: bool = False  # the ledger or the sleep wish changed since the keeper last looked
    warm: bool = False  # its engine has served one generation (its first step is behind it)


@dataclass(frozen=True)
class Candidate:
    name: str
    version: int | None
    asleep: bool


def choose(candidates: Iterable[Candidate], current: int | None) -> str | None:
    """The spare to promote: awake and current first, then awake and behind, then asleep
    (a wake costs seconds on a GPU, a replay of a small delta often less). Pure logic."""

    def cost(c: Candidate) -> tuple[bool, bool, str]:
        return (c.asleep, c.version != current, c.name)

    ranked = sorted(candidates, key=cost)
    return ranked[0].name if ranked else None


def rebalanced(
    roles: Mapping[str, Role], order: Sequence[str], wanted: int
) -> tuple[int, list[str]]:
    """How to bring the shards in `order` (start order) to `wanted` serving: (how many
    spares to promote, which serving shards become spares). A promotion under way counts as
    serving; a shard with no role (not ready yet) counts as neither: it takes the role the
    count gives it when it turns ready. The shards made spares are the last serving ones in
    start order, as roles are first given. Pure logic."""
    serving = [n for n in order if roles.get(n) in {Role.SERVING, Role.PROMOTING}]
    spares = [n for n in order if roles.get(n) is Role.SPARE]
    if len(serving) < wanted:
        return min(wanted - len(serving), len(spares)), []
    extra = len(serving) - max(wanted, 0)
    return 0, [n for n in reversed(order) if roles.get(n) is Role.SERVING][:extra]


class SparePool:
    """The spares of one shard group, driven through the policy manager's shard operations
    (`ShardDriver`). The policy manager calls it at a few points:
    `assign` when a shard turns ready, `lost` when a serving shard goes stale, `refresh`
    after a push or publish, and asks `is_serving` / `taints` / `record`. As an engine
    hook it watches every ready shard for its death (`on_ready`, `on_exit`), and hears of
    shards the engine is about to kill as lost (`on_lost`)."""

    def __init__(self, driver: ShardDriver, count: int) -> None:
        self.driver = driver
        self.count = count
        self.slots: dict[str, Slot] = {}
        self.sleep_wanted = False
        self._promotions: set[asyncio.Task[None]] = set()
        self._pushed_at: float | None = None
        self._watches: dict[str, DeathWatch] = {}
        # shard -> why it was taken into service, how often; from its first role on
        self.promotions: dict[str, Counter[str]] = {}

    # ------------------------------------------------------------------ roles

    def wanted(self) -> int:
        """How many shards serve: all of them but the spares."""
        return max(len(self.driver.shard_names) - self.count, 0)

    def assign(self, unit: Unit) -> Role:
        """A shard turned ready: it serves if the serving count is short, else it is a spare."""
        serving = sum(1 for s in self.slots.values() if s.role is not Role.SPARE)
        role = Role.SERVING if self.count == 0 or serving < self.wanted() else Role.SPARE
        self.slots[unit.name] = Slot(role)
        self.promotions.setdefault(unit.name, Counter())
        self._show_in_detail(unit)
        return role

    def role(self, unit: Unit) -> Role:
        slot = self.slots.get(unit.name)
        return slot.role if slot else Role.SERVING

    def is_serving(self, unit: Unit) -> bool:
        return self.role(unit) is Role.SERVING

    def is_spare(self, unit: Unit) -> bool:
        return self.role(unit) is Role.SPARE

    def taints(self, unit: Unit, version: int) -> list[str]:
        """A spare carries no policy taint, so trainer traffic never reaches it."""
        if self.is_spare(unit):
            return []
        return [f"{self.driver.spec.taint_prefix}{version}"]

    def recorded(self, unit: Unit, ack: ShardAck) -> None:
        """The manager recorded that a spare holds `ack.version` (replayed, KV reset,
        verified, untainted)."""
        self._show_in_detail(unit)
        current = self.driver.current_version
        if ack.version == current and self._pushed_at is not None:  # noqa: SIM102
            if all(self._version(u) == current for u in self.spare_units()):
                log.info(
                    "spares.current",
                    version=ack.version,
                    since_push_ms=round((time.monotonic() - self._pushed_at) * 1000, 1),
                )
                self._pushed_at = None

    def after_ready(self, unit: Unit) -> None:
        """A spare finished catching up: keep it current, or promote it at once if the
        serving count fell short meanwhile (a serving shard died while no spare was up)."""
        slot = self.slots.get(unit.name)
        if slot is None or slot.role is not Role.SPARE:
            return
        serving = sum(1 for s in self.slots.values() if s.role is not Role.SPARE)
        if serving < self.wanted():
            slot.role = Role.PROMOTING
            task = asyncio.get_running_loop().create_task(
                self._promote(unit, slot, "-", Reason.EXIT, "serving count short", time.monotonic())
            )
            self._promotions.add(task)
            task.add_done_callback(self._promotions.discard)
            return
        self._keep_current(unit)

    def spare_units(self) -> list[Unit]:
        units = self.driver.engine.units
        return [units[n] for n, s in self.slots.items() if s.role is Role.SPARE]

    def _version(self, unit: Unit) -> int | None:
        return self.driver.shard_policy(unit).version

    def _behind(self, unit: Unit) -> int | None:
        version, current = self._version(unit), self.driver.current_version
        return current - version if version is not None and current is not None else None

    def unit_status(self, unit: Unit) -> ExtensionUnitStatus:
        """The shard's `spare` key in status, once it was first given a role."""
        promotions = self.promotions.get(unit.name)
        if promotions is None:
            return {}
        slot = self.slots.get(unit.name)
        spare: SpareStatus = {
            "role": str(slot.role) if slot else None,
            "sleeping": bool(slot and slot.asleep),
            "warm": bool(slot and slot.warm),
            "promotions": dict(promotions),
        }
        if slot is not None and slot.role is Role.SPARE:
            spare["version"], spare["behind"] = self._version(unit), self._behind(unit)
        return {"spare": spare}

    def _show_in_detail(self, unit: Unit) -> None:
        """A spare's role in its status detail: the version it holds, awake or asleep."""
        slot = self.slots.get(unit.name)
        if slot is None or slot.role is not Role.SPARE:
            return
        version, behind = self._version(unit), self._behind(unit)
        state = "asleep" if slot.asleep else "awake, warm" if slot.warm else "awake"
        lag = "current" if behind == 0 else f"{behind} behind" if behind else "catching up"
        self.driver.engine.transition(
            unit, unit.state, f"spare at policy version {version} ({lag}, {state})"
        )

    # ------------------------------------------------------------------ promotion

    async def before_start(self, unit: Unit) -> None:
        """Engine hook: nothing before a start."""

    async def on_ready(self, unit: Unit) -> None:
        """Engine hook: watch the shard for its death (roles are assigned by the policy
        manager's own on_ready, next in line)."""
        self._watch(unit)

    def _watch(self, unit: Unit) -> None:
        pid = unit.pid
        if unit.name not in self.driver.shard_names or self.count == 0 or pid is None:
            return
        old = self._watches.pop(unit.name, None)
        if old is not None:
            old.close()

        def dying(why: str) -> None:
            log.info("spares.shard_dying", unit=unit.name, pid=pid, why=why)
            if unit.pid == pid:
                self.lost(unit, Reason.EXIT, f"pid {pid} dying ({why})")

        watch = DeathWatch(pid, dying)
        if watch.start():
            self._watches[unit.name] = watch

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        """Engine hook, first in line: if the death watch did not see it die first, the
        promotion starts here, before the dead shard's lease is revoked (that runs in
        parallel, in the next hook), not after."""
        watch = self._watches.pop(unit.name, None)
        if watch is not None:
            watch.close()
        if unit.name in self.driver.shard_names:
            self.lost(unit, Reason.EXIT, exit.describe())

    def on_lost(self, unit: Unit, why: str) -> None:
        """Engine listener: a shard is about to be killed as hung. Its spare takes over
        now, not once the kill has been reaped."""
        if unit.name in self.driver.shard_names:
            self.lost(unit, Reason.LOST, why)

    def lost(self, unit: Unit, reason: Reason, detail: str) -> None:
        """A shard left service. A serving one is replaced by a spare, if one is there."""
        if reason is Reason.EXIT:
            slot = self.slots.pop(unit.name, None)
            if slot is not None and slot.keeper is not None:
                slot.keeper.cancel()
            self.promotions.setdefault(unit.name, Counter())  # status: no role while it is down
        else:
            slot = self.slots.get(unit.name)
        if self.count == 0 or slot is None or slot.role is Role.SPARE:
            return
        if self.driver.engine.stopping:
            return
        if reason is not Reason.EXIT:
            if not self._available():
                return
            slot.role = Role.SPARE  # it rejoins as a spare; the promoted one takes its place
            self._show_in_detail(unit)
        # (a shard swapped out is a spare now, but never its own replacement)
        self._promote_one(unit.name, reason, detail, time.monotonic(), exclude={unit.name})

    def _available(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Candidate]:
        units = self.driver.engine.units
        return [
            Candidate(name, self._version(units[name]), slot.asleep)
            for name, slot in self.slots.items()
            if slot.role is Role.SPARE
            and name not in exclude
            and units[name].state.running
            and units[name].hold_reason is None
        ]

    def _promote_one(
        self, replaced: str, reason: Reason, detail: str, since: float, exclude: set[str]
    ) -> asyncio.Task[None] | None:
        name = choose(self._available(exclude), self.driver.current_version)
        if name is None:
            log.warning("spares.none_available", replaced=replaced, reason=str(reason))
            return None
        slot = self.slots[name]
        slot.role = Role.PROMOTING
        log.info("spares.promoting", unit=name, replaced=replaced, reason=str(reason), why=detail)
        task = asyncio.get_running_loop().create_task(
            self._promote(self.driver.engine.units[name], slot, replaced, reason, detail, since)
        )
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)
        return task

    async def _promote(
        self, unit: Unit, slot: Slot, replaced: str, reason: Reason, detail: str, since: float
    ) -> None:
        driver = self.driver
        timings: dict[str, float] = {}
        replay_ms = 0.0

        async def timed(name: str, route: str, payload: dict[str, Any]) -> dict[str, Any]:
            started = time.monotonic()
            reply = await driver.call(unit, route, payload)
            timings[name] = timings.get(name, 0.0) + (time.monotonic() - started) * 1000
            return reply

        was_version, was_asleep = self._version(unit), slot.asleep
        own = driver.routing_taints(unit, 0)[1]  # its instance taints, whatever the version
        try:
            async with slot.lock:
                waited = (time.monotonic() - since) * 1000
                if slot.asleep:
                    await timed("wake", "control/wake_up", {})
                    slot.asleep = False
                while True:
                    version = driver.current_version
                    if version is None or self._version(unit) != version:
                        # behind (or the ledger not read yet): the replay needs its path
                        target = await driver.ledger().current()
                        driver.note_current(target)
                        version = target.version if target else driver.spec.initial_version
                    if self._version(unit) != version:
                        started = time.monotonic()
                        ack = await driver.apply(unit, target)  # taints: it is promoting
                        replay_ms = (time.monotonic() - started) * 1000
                    # Pushes and publishes move `current_version` under this lock, so under
                    # it the cached version is the ledger's.
                    async with driver.lock:
                        if driver.current_version != version:
                            continue  # a push overtook the replay: replay again
                        if replay_ms == 0.0:
                            ack = await self._admit_current(unit, version, own, timed, timings)
                        slot.role = Role.SERVING
                        ack.timings_ms = {**timings, **ack.timings_ms}
                        self._promoted(
                            unit, reason, replaced=replaced, why=detail, version=version,
                            was_version=was_version, was_asleep=was_asleep,
                            waited_ms=round(waited, 1), replay_ms=round(replay_ms, 1),
                            steps_ms={k: round(v, 1) for k, v in ack.timings_ms.items()},
                            total_ms=round((time.monotonic() - since) * 1000, 1),
                        )  # fmt: skip
                        await driver.record_ack(unit, ack)
                        break
        except DynamodError as exc:  # EtcdError is one
            log.warning(
                "spares.promotion_failed", unit=unit.name, replaced=replaced, error=str(exc)
            )
            if self.slots.get(unit.name) is slot:  # alive: try the next spare instead
                slot.role = Role.SPARE
                with contextlib.suppress(DynamodError):  # tainted, but never routed to
                    await driver.call(unit, "update/model_taints", {"taints": own})
                self._keep_current(unit)
                self._promote_one(replaced, reason, detail, since, exclude={unit.name})
            # (a spare that died while promoted was replaced by `lost`, as a serving one)

    async def _admit_current(
        self,
        unit: Unit,
        version: int,
        own: list[str],
        timed: Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]],
        timings: dict[str, float],
    ) -> ShardAck:
        """A spare already at `version`: verified when it was replayed, and only dynamod
        calls its admin routes (a restarted process gets a new slot), so the taint is the
        one call between the loss and the spare serving, and the canary through the
        frontend says the router has seen it."""
        await timed(
            "taint", "update/model_taints", {"taints": [*self.taints(unit, version), *own]}
        )
        started = time.monotonic()
        await self.driver.routed(unit, version)
        timings["route"] = (time.monotonic() - started) * 1000
        return ShardAck(unit.name, version, self.driver.shard_policy(unit).digest)

    def _promoted(self, unit: Unit, reason: Reason, **facts: Any) -> None:
        """A spare serves: counted, logged in full, and recorded for `dynamod events`."""
        self._count_promotion(unit, reason)
        self.driver.event(
            "spares.promoted",
            unit.name,
            reason=str(reason),
            **{k: facts[k] for k in ("replaced", "version", "total_ms")},
        )
        log.info("spares.promoted", unit=unit.name, reason=str(reason), **facts)

    def _count_promotion(self, unit: Unit, reason: Reason) -> None:
        self.promotions.setdefault(unit.name, Counter())[str(reason)] += 1
        self._show_in_detail(unit)

    # ------------------------------------------------------------------ live changes

    async def fill(
        self, order: Sequence[str], wanted: int, leaving: set[str], timeout: float
    ) -> None:
        """Before an apply removes the shards `leaving`: promote spares among the shards
        that stay (`order`) until `wanted` of them serve, and wait for those promotions, so
        a removed serving shard is replaced before it is drained, not after it stopped."""
        roles = {n: s.role for n, s in self.slots.items() if n in order}
        promote, _ = rebalanced(roles, order, wanted)
        why = f"{', '.join(sorted(leaving)) or 'no shard'} removed by `dynamod apply`"
        started = time.monotonic()
        tasks = [
            task
            for _ in range(promote)
            if (task := self._promote_one("-", Reason.APPLY, why, started, exclude=leaving))
        ]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def retire(self, name: str) -> None:
        """An apply removes the shard: it leaves the pool now, so its stop promotes no
        spare in its place (the count it leaves is the new table's) and it is never
        promoted itself."""
        slot = self.slots.pop(name, None)
        if slot is not None and slot.keeper is not None:
            slot.keeper.cancel()
        watch = self._watches.pop(name, None)
        if watch is not None:
            watch.close()

    def resize(self, count: int) -> None:
        """The stack was adopted (apply, scale): `count` spares, of the shards it has now.
        Shards it no longer has are forgotten; spares are promoted, or the last serving
        shards become spares, until the roles match (`rebalanced`)."""
        was, self.count = self.count, count
        names = self.driver.shard_names
        for name in [n for n in self.slots if n not in names]:
            self.retire(name)
        for name in [n for n in self.promotions if n not in names]:
            del self.promotions[name]
        order = [n for n in self.driver.engine.units if n in names]
        roles = {n: s.role for n, s in self.slots.items()}
        wanted = len(order) if count == 0 else max(len(order) - count, 0)
        promote, demote = rebalanced(roles, order, wanted)
        if promote or demote or was != count:
            log.info("spares.resized", spares=count, was=was, serving=wanted,
                     promote=promote, demote=demote)  # fmt: skip
        why = f"[policy] spares = {count} of {len(order)} shard(s)"
        for _ in range(promote):
            self._promote_one("-", Reason.APPLY, why, time.monotonic(), exclude=set())
        for name in demote:
            self._demote(self.driver.engine.units[name], self.slots[name], why)
        if was == 0 and count > 0:  # serving shards were not watched without spares
            for name in self.slots:
                self._watch(self.driver.engine.units[name])

    def _demote(self, unit: Unit, slot: Slot, why: str) -> None:
        """A serving shard becomes a spare: out of the push set at once, its version taint
        dropped (no new trainer traffic; what is in flight finishes), then kept current."""
        slot.role = Role.SPARE

        async def untaint() -> None:
            driver = self.driver
            own = driver.routing_taints(unit, 0)[1]
            try:
                async with slot.lock, driver.lock:
                    await driver.call(unit, "update/model_taints", {"taints": own})
                    shard = driver.shard_policy(unit)
                    if shard.version is not None:
                        await driver.record_ack(unit, ShardAck(unit.name, shard.version,
                                                               shard.digest))  # fmt: skip
            except DynamodError as exc:
                log.warning("spares.demotion_failed", unit=unit.name, error=str(exc))
                driver.note_error(unit, f"made a spare, but its version taint stays: {exc}")
            driver.event("spares.demoted", unit.name, why=why)
            log.info("spares.demoted", unit=unit.name, why=why)
            self._keep_current(unit)

        task = asyncio.get_running_loop().create_task(untaint())
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)

    # ------------------------------------------------------------------ keeping current

    def refresh(self) -> None:
        """The ledger moved on (push, publish): replay it into every spare, in the background."""
        if self.count == 0:
            return
        self._pushed_at = time.monotonic()
        for unit in self.spare_units():
            self._keep_current(unit)

    def _keep_current(self, unit: Unit) -> None:
        slot = self.slots.get(unit.name)
        if slot is None:
            return
        slot.dirty = True
        if slot.keeper is not None and not slot.keeper.done():
            return
        slot.keeper = asyncio.get_running_loop().create_task(self._keeper(unit, slot))

    async def _keeper(self, unit: Unit, slot: Slot) -> None:
        """Until the spare holds the current version (and sleeps if asked), or stops being one."""
        driver = self.driver
        delay = driver.spec.replay_backoff_initial
        while self.slots.get(unit.name) is slot and slot.role is Role.SPARE:
            error = None
            async with slot.lock:
                if slot.role is not Role.SPARE:
                    return
                slot.dirty = False
                try:
                    target = await driver.ledger().current()
                    driver.note_current(target)
                    version = target.version if target else driver.spec.initial_version
                    if self._version(unit) == version or slot.asleep:
                        # a sleeping spare cannot load weights: it is replayed when woken
                        if self.sleep_wanted != slot.asleep:
                            route = "control/sleep" if self.sleep_wanted else "control/wake_up"
                            await driver.call(
                                unit, route, {"level": 1} if self.sleep_wanted else {}
                            )
                            slot.asleep = self.sleep_wanted
                            self._show_in_detail(unit)
                            log.info(
                                "spares.slept" if slot.asleep else "spares.woke", unit=unit.name
                            )
                            continue
                        if not slot.asleep and not slot.warm:
                            await self._warm(unit, slot)
                        self._show_in_detail(unit)
                        if slot.dirty:
                            continue
                        return
                    ack = await driver.apply(unit, target)
                    async with driver.lock:
                        now = await driver.ledger().current()
                        if (now.version if now else driver.spec.initial_version) == ack.version:
                            await driver.record_ack(unit, ack)
                    continue
                except DynamodError as exc:  # EtcdError is one
                    error = str(exc)
            log.warning("spares.replay_failed", unit=unit.name, error=error, retry_s=delay)
            driver.note_error(unit, error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, driver.spec.replay_backoff_max)

    async def _warm(self, unit: Unit, slot: Slot) -> None:
        """A current, awake spare serves one generation of dynamod's own before it is
        needed: on the real engine the first one after a start took 32 s on a CPU, and it
        fell on the promotion (real-engine.md). A failure is logged; the next keeper round
        (after the next push) tries again, and the promotion's canary warms it at worst."""
        try:
            ms = await self.driver.warm(unit)
        except DynamodError as exc:
            log.warning("spares.warm_failed", unit=unit.name, error=str(exc))
            return
        if ms is not None:
            slot.warm = True
            log.info("spares.warmed", unit=unit.name, ms=round(ms, 1))

    # ------------------------------------------------------------------ sleep, views

    def set_sleep(self, asleep: bool) -> None:
        self.sleep_wanted = asleep
        for unit in self.spare_units():
            self._keep_current(unit)

    async def stop(self) -> None:
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        tasks = [*self._promotions, *(s.keeper for s in self.slots.values() if s.keeper)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def summary(self) -> dict[str, Any]:
        current = self.driver.current_version
        spares = self.spare_units()
        promotions = sum(
            self.promotions[n].total() for n in self.driver.shard_names if n in self.promotions
        )
        return {
            "wanted": self.count,
            "spares": [u.name for u in spares],
            "available": len(self._available()),
            "current": sum(1 for u in spares if self._version(u) == current),
            "sleep": self.sleep_wanted,
            "promotions": promotions,
        }

    def routes(self) -> list[web.RouteDef]:
        async def sleep(request: web.Request) -> web.Response:
            try:
                body = await request.json()
                asleep = body["sleep"]
                if not isinstance(asleep, bool):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise DynamodError('expected a JSON body {"sleep": true|false}') from None
            self.set_sleep(asleep)
            return web.json_response(self.summary())

        return [web.post("/policy/spares", sleep)]

