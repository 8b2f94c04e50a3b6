"""Policy updates and the rejoin protocol.

A rollout shard serves traffic only at the ledger's current policy version:

  push:    on every admitted shard in parallel: pause -> update_weights_from_disk ->
           flush_cache -> verify version (+ digest) -> taint `dynamod.policy/<v>` -> resume.
           The ledger advances once the push completes; shards that failed are stale.
  publish: the trainer loaded the weights itself; dynamod records the version (and the
           digest the shards acknowledged), verifies, taints and resumes every admitted
           shard; a mismatch, or a shard the trainer has no acknowledgement from, is stale.
  rejoin:  a shard that (re)starts, or is stale, is `held` (paused, no current taint)
           while the ledger's current version is replayed into it, its KV cache reset and
           its version verified; only then is it admitted. Retries with backoff, forever
           while the process lives; a shard that cannot catch up stays out and says why.

Trainer traffic requires the current version's taint (`nvext.routing_constraints`), so
the kv router never sends it to a held or stale shard, whatever the timing. Plain traffic
(no constraint) is kept off a (re)started shard by the shard itself: every shard is spawned
with DYNAMOD_WORKER_START_PAUSED=1, so the CPU worker registers with Dynamo already
paused and what the router sends it waits until the rejoin's resume admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web

from dynamod.core.errors import DynamodError
from dynamod.core.extensions import Extension
from dynamod.core.restart import Exit
from dynamod.core.slots import Slots
from dynamod.core.spec import Stack
from dynamod.core.state import UnitState
from dynamod.core.status import ExtensionUnitStatus
from dynamod.core.stopwatch import Stopwatch
from dynamod.rollout import dynamo, policy_table
from dynamod.rollout.etcd import EtcdAuth, EtcdClient, EtcdError, WatchEvent
from dynamod.rollout.ledger import EtcdLedger, FileLedger, Ledger, PolicyVersion, ShardRecord
from dynamod.rollout.pause_claims import Claim, PauseClaims
from dynamod.rollout.policy_table import PolicySpec
from dynamod.rollout.push_acks import Acks, Updates, collect
from dynamod.rollout.registrations import DynamoRegistrations
from dynamod.rollout.shard_driver import ShardAck, ShardPolicy
from dynamod.rollout.spares import Reason, Role, SparePool
from dynamod.rollout.worker_table import DynamoFrontendProbe, worker_of

if TYPE_CHECKING:
    from dynamod.core.engine import Engine, Unit
    from dynamod.core.extensions import ExtensionHost
    from dynamod.core.spec import UnitSpec

log = structlog.get_logger("dynamod.rollout.policy")


_INSTANCE_TAINT = "dynamod.instance/"  # each shard's own taint, so a canary can target it
# A canary is given at least this long, and otherwise the rest of route_timeout.
_ROUTE_ATTEMPT_S = 5.0
# The frontend usually sees a new taint within milliseconds of the call that set it, and
# within seconds after etcd came back: the canaries after a miss start _ROUTE_RETRY_FIRST_S
# apart and double up to _ROUTE_RETRY_S. A shard still not routed after _ROUTE_PATIENT_S
# waits on something slower (a frontend with no endpoints, a starved machine), and its
# canaries go on doubling up to _ROUTE_RETRY_SLOW_S: 32 held shards sent ~300 canaries/s at
# the 0.1 s cap (the fleet benchmark at 8 x 32), load that fed the starvation they waited on.
_ROUTE_RETRY_FIRST_S = 0.01
_ROUTE_RETRY_S = 0.1
_ROUTE_PATIENT_S = 2.0
_ROUTE_RETRY_SLOW_S = 1.0
# Test-only, for the chaos suite's broken variant (never set it in production): a shard
# that rejoins is admitted without the current weights being replayed into it, so the
# stale-serving checker has a real violation to catch. Read once, here only.
ADMIT_WITHOUT_REPLAY = os.environ.get("DYNAMOD_TEST_ADMIT_WITHOUT_REPLAY") == "1"
# Set on every shard spawned: the CPU worker (dynamod/workers/cpu/args.py, which names it
# too: neither layer may import the other) starts paused, so it serves nothing before its
# rejoin admits it. Other engines ignore it.
START_PAUSED_ENV = "DYNAMOD_WORKER_START_PAUSED"

# Setting a shard's taints is Dynamo's own write to etcd (its model card). Dynamo 1.6.1's
# etcd client fails a call in flight to a member that stopped answering ("Internal etcd
# error: ... KeepAliveTimedOut", seen with the head's member of a 3-member etcd frozen), and
# with a member gone it keeps sending a share of the calls there ("tcp connect error ...
# Connection reset", seen: 1 to 4 such failures in a row per push, each within ms, in the
# cluster-ha test; 4 attempts were once not enough). The write is idempotent, so it is sent
# again for as long as _TAINT_RETRY_BUDGET_S, not a number of times.
_ETCD_TRANSIENT = "Internal etcd error"
_TAINT_RETRY_BUDGET_S = 10.0
_TAINT_RETRY_S = 0.25


def is_transient_etcd_failure(route: str, detail: str) -> bool:
    """A failed taint write that another attempt may get through (Dynamo's etcd client)."""
    return route == "update/model_taints" and _ETCD_TRANSIENT in detail


def route_retry(gap_s: float | None, waited_s: float) -> float:
    """Seconds until the next route canary after a miss: `gap_s` the last gap (None after
    the first canary), `waited_s` since the wait began."""
    if gap_s is None:
        return _ROUTE_RETRY_FIRST_S
    cap = _ROUTE_RETRY_S if waited_s < _ROUTE_PATIENT_S else _ROUTE_RETRY_SLOW_S
    return min(gap_s * 2, cap)


def send_again(route: str, detail: str, elapsed_s: float) -> bool:
    """Whether a failed step is sent again: a transient taint write, within the budget."""
    return is_transient_etcd_failure(route, detail) and elapsed_s < _TAINT_RETRY_BUDGET_S


class PolicyError(DynamodError):
    """A push, publish or replay could not be done; says where and why."""


class ShardError(PolicyError):
    def __init__(self, shard: str, step: str, detail: str) -> None:
        self.shard, self.step, self.detail = shard, step, detail
        super().__init__(f"{shard}: {step} failed: {detail}")


def check_checkpoint(path: Path) -> list[Path]:
    """The checkpoint directory holds readable safetensors files; names the one at fault."""
    if not path.exists():
        raise PolicyError(f"checkpoint {path} does not exist")
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise PolicyError(f"checkpoint {path} holds no *.safetensors file")
    for file in files:
        try:
            with file.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100_000_000:
                    raise ValueError(f"header length {size} is implausible")
                header = json.loads(fh.read(size))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (OSError, ValueError, struct.error) as exc:
            raise PolicyError(f"checkpoint file {file} is not valid safetensors: {exc}") from None
    return files


def agreed_digest(acks: Mapping[str, str | None] | None) -> str | None:
    """The digest most acknowledging shards computed (None without digests)."""
    counts = Counter(d for d in (acks or {}).values() if d)
    return counts.most_common(1)[0][0] if counts else None


async def on_this_node(target: PolicyVersion) -> None:
    """PolicyError unless `target`'s checkpoint is on this node's storage, read before the
    shard is asked to load it: a replay on another node than the one that wrote it finds
    it only on storage both read. Off the loop: a hung network mount hangs a thread."""
    if not await asyncio.to_thread(os.path.exists, target.path):
        raise PolicyError(
            f"version {target.version}'s checkpoint {target.path} is not on this node's "
            "storage: removed, or written on another node's own disk (a cluster's "
            "checkpoints must be on storage every node reads; docs/multi-node.md)"
        )


class PolicyManager(Extension):
    """Daemon extension + engine hook: the ledger, pushes, publishes and rejoins.

    Control socket routes:
      GET  /policy           the policy ledger and every shard's applied version
      POST /policy/push      {"step": N, "path": DIR[, "serving": K]}: load into every
                             admitted shard (answer once K serve it, the rest after)
      POST /policy/publish   {"step": N, "path": DIR, "acks": {shard: digest}}: the trainer
                             loaded it; verify shards
      POST /policy/spares    {"sleep": true|false}: spares sleep (control/sleep) or wake
    """

    def __init__(
        self,
        spec: PolicySpec,
        registrations: DynamoRegistrations,
        *,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        self.spec = spec
        self.registrations = registrations  # the shards' Dynamo instance ids
        self.etcd_auth = etcd_auth  # a cluster stack's credentials for its ledger's etcd
        self.host: ExtensionHost | None = None
        self.lock = asyncio.Lock()  # one push, publish or admission at a time
        self._rejoins: dict[str, asyncio.Task[None]] = {}
        self.current_version: int | None = None  # None until the ledger was first read
        # the ledger's record this node last brought its shards to, or committed itself
        self._noted: PolicyVersion | None = None
        self._etcd: EtcdClient | None = None
        self._closing: set[asyncio.Task[None]] = set()  # etcd clients left for a moved port
        self._file: FileLedger | None = None
        self.shard_names: set[str] = set()
        self._shards: dict[str, ShardPolicy] = {}  # shard name -> what is known of its policy
        self.spares = SparePool(self, spec.spares)
        # pauses made outside dynamod (verl's ranks and rollout servers), by whom
        self.claims = PauseClaims(self._claimer_gone)
        self._removing: set[str] = set()  # the shards an apply in progress removes
        # `[policy] max_updating`: this node's shards applying an update at once
        self.update_slots = Slots(spec.max_updating, "max_updating", "updating")
        # Set by a multi-node layer: after a push committed, wait for the other nodes'
        # shards (step -> what to add to the push's answer).
        self.after_commit: Callable[[int], Awaitable[dict[str, Any]]] | None = None
        # A push answered early (`serving`): the task finishing it, and its shards' updates
        self._push_rest: (
            tuple[asyncio.Task[None], dict[asyncio.Task[ShardAck], str]] | None
        ) = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: ExtensionHost) -> None:
        assert host.engine is not None
        self.host = host
        self.shard_names = set(policy_table.shards(host.stack))
        host.engine.hooks.append(self)
        host.engine.hooks.insert(0, self.spares)
        host.engine.lost_listeners.append(self.spares.on_lost)
        host.engine.restack_listeners.append(self.restacked)
        if self.spec.store == "etcd":
            self._etcd = self._etcd_client()
        else:
            self._file = FileLedger(host.state_dir / "policy.json")

    def _etcd_client(self) -> EtcdClient:
        assert self.spec.etcd and self.host is not None and self.host.engine is not None
        return EtcdClient(self.spec.etcd, session=self.host.engine.session, auth=self.etcd_auth)

    def restacked(self, stack: Stack) -> None:
        """The engine re-rendered the stack (a port it references moved) or adopted a new
        one (`apply`): the shards are the new stack's (a new replica is held and replayed
        like any restarted shard) and the ledger's etcd endpoint follows, so the next push,
        publish or replay talks to where etcd is now. The spare pool takes the new table's
        count: roles are rebalanced until that many spares are left."""
        self.shard_names = set(policy_table.shards(stack))
        self._removing.clear()
        policy = policy_table.policy_of(stack)
        if policy is None:
            return
        self.spares.resize(policy.spares)  # [policy] spares, of the shards there are now
        self.update_slots.set_limit(policy.max_updating)  # a raised limit starts the waiting
        if policy == self.spec:
            return
        moved = policy.etcd != self.spec.etcd
        self.spec = policy
        if moved and self._etcd is not None:
            old, self._etcd = self._etcd, self._etcd_client()
            task = asyncio.get_running_loop().create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info("policy.etcd_moved", etcd=str(self.spec.etcd))

    async def stop(self) -> None:
        await self.spares.stop()
        self.claims.close()
        if self._push_rest is not None:  # a push answered early: its shards' updates end
            rest, pending = self._push_rest
            for task in (rest, *pending):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rest
        for task in list(self._rejoins.values()):
            task.cancel()
        for task in list(self._rejoins.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ apply

    async def settle(self) -> None:
        """A push, publish or admission in flight finishes before an apply begins."""
        async with self.lock:
            return

    async def prepare(self, new: Stack, removed: list[str], timeout: float) -> None:
        """Before an apply removes shards: a spare that stays is promoted for each serving
        shard the new table would be short of, so the spare role goes, not a serving one."""
        policy = policy_table.policy_of(new)
        self._removing = {n for n in removed if n in self.shard_names}
        if policy is None or not self._removing:
            return
        shards = policy_table.shards(new)
        staying = [n for n in shards if n in self.shard_names]
        wanted = min(len(staying), len(shards) - policy.spares)
        await self.spares.fill(staying, wanted, self._removing, timeout)

    def may_stop(self, unit: Unit) -> str | None:
        """An admitted shard goes out of service only if min_ready_shards stay admitted."""
        admitted = self.admitted_shards()
        if unit.name not in self.shard_names or unit not in admitted:
            return None
        left, least = len(admitted) - 1, self.spec.min_ready_shards
        if left >= least:
            return None
        return (f"without it {left} shard(s) would be admitted, fewer than [policy] "
                f"min_ready_shards={least}")  # fmt: skip

    async def drain(self, unit: Unit, why: str) -> None:
        """Before an apply stops a shard (the registrations' drain, earlier in line, took
        it out of the frontend's routing already): hold it (no push includes it), drop its
        version taint (no trainer traffic, should it be routed again) and pause it in
        `wait` mode, which returns once its in-flight requests have finished. A shard the
        apply removes leaves the spare pool first: its stop promotes no spare."""
        if unit.name not in self.shard_names or not unit.state.running:
            return
        started = time.monotonic()
        if unit.name in self._removing:  # its stop promotes no spare in its place
            self.spares.retire(unit.name)
        self.engine.hold(unit, f"draining: {why}")
        self._shard_policy(unit.name).admitted = False
        _, own = self.routing_taints(unit, self.current_version or 0)
        try:
            async with asyncio.timeout(self.spec.call_timeout):
                await self.call(unit, "update/model_taints", {"taints": own})
                await self.call(unit, "pause_generation", {"mode": "wait"})
            outcome = "drained: out of routing, no request in flight"
        except (ShardError, TimeoutError) as exc:
            outcome = f"not drained ({exc or 'timed out'}); stopped anyway"
        took = round((time.monotonic() - started) * 1000, 1)
        self.engine.set_detail(unit, f"{outcome} in {took:.0f} ms")
        self.event("shard.drained", unit.name, why=why, outcome=outcome, ms=took)
        log.info("policy.shard_drained", unit=unit.name, why=why, outcome=outcome, ms=took)

    def spawn_env(self, unit: UnitSpec) -> Mapping[str, str]:
        """A shard comes up paused, so it serves nothing before its rejoin admits it (the
        rejoin's own pause is then a no-op and its resume the first admission)."""
        return {START_PAUSED_ENV: "1"} if unit.name in self.shard_names else {}

    def routes(self) -> list[web.RouteDef]:
        async def step_and_path(request: web.Request) -> tuple[int, str]:
            try:
                body = await request.json()
                return int(body["step"]), str(body["path"])
            except (ValueError, KeyError, TypeError):
                raise DynamodError('expected a JSON body {"step": N, "path": "DIR"}') from None

        async def acks_of(request: web.Request) -> dict[str, str | None] | None:
            acks = (await request.json()).get("acks")
            if acks is None:
                return None
            if not isinstance(acks, dict) or not all(
                isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in acks.items()
            ):
                raise DynamodError('"acks" must map shard names to digests (or null)')
            return acks

        def running() -> None:
            assert self.host is not None
            self.host.require_running("a policy update")

        async def push(request: web.Request) -> web.Response:
            running()
            step, path = await step_and_path(request)  # a body that is not a JSON object fails
            serving = (await request.json()).get("serving")
            if serving is not None and (type(serving) is not int or serving < 1):
                raise DynamodError('"serving" must be a whole number of shards, at least 1')
            return web.json_response(await self.push(step, path, serving))

        async def publish(request: web.Request) -> web.Response:
            running()
            step, path = await step_and_path(request)
            return web.json_response(await self.publish(step, path, await acks_of(request)))

        async def status(_: web.Request) -> web.Response:
            return web.json_response(await self.status_full())

        return [
            web.get("/policy", status),
            web.post("/policy/push", push),
            web.post("/policy/publish", publish),
            *self.spares.routes(),
            *self.claims.routes(lambda: self.shard_names),
        ]

    def status(self) -> dict[str, Any]:
        return {"policy": self.summary()}

    @property
    def engine(self) -> Engine:
        assert self.host is not None and self.host.engine is not None
        return self.host.engine

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.engine.session

    def ledger(self) -> Ledger:
        if self._etcd is not None:
            return EtcdLedger(self._etcd, self.engine.stack.identity)
        assert self._file is not None
        return self._file

    def ledger_changes(self, start_revision: int | None = None
                       ) -> AsyncIterator[WatchEvent] | None:
        """The ledger's current version as pushes move it (a watch; from the store's
        `start_revision`), where the ledger is in etcd; None for a file ledger (one node:
        no other node's push to follow)."""
        if self._etcd is None:
            return None
        return EtcdLedger(self._etcd, self.engine.stack.identity).changes(start_revision)

    async def ledger_read(self) -> tuple[PolicyVersion | None, int] | None:
        """The ledger's current version and the store's revision as of that read (None: a
        file ledger): a watch from the revision after it misses no move."""
        if self._etcd is None:
            return None
        return await EtcdLedger(self._etcd, self.engine.stack.identity).current_at()

    # ------------------------------------------------------------------ hooks

    async def on_ready(self, unit: Unit) -> None:
        """A shard passed its readiness probe: hold it until it holds the current policy."""
        if unit.name not in self.shard_names:
            return
        role = self.spares.assign(unit)
        self.engine.hold(unit, "held: waiting to replay the current policy")
        await self._catch_up(unit)
        if role is Role.SPARE:
            self.spares.after_ready(unit)

    async def before_start(self, unit: Unit) -> None:
        """Engine hook: nothing before a start (a shard is held at its readiness)."""

    async def on_exit(self, unit: Unit, exit: Exit) -> None:
        task = self._rejoins.pop(unit.name, None)
        if task is not None:
            task.cancel()
        self.claims.ended(unit.name)
        if unit.name in self.shard_names:
            self._shard_policy(unit.name).exited()

    # ------------------------------------------------------------------ rejoin

    async def _catch_up(self, unit: Unit, known: PolicyVersion | None = None) -> None:
        """Replay the ledger's current version until it sticks. Returns when admitted.

        Replays of different shards run in parallel (a GPU shard's load takes seconds);
        only the admission takes the policy lock, and it checks that no push moved the
        ledger on meanwhile, else the replay starts over at the new version. `known`: the
        current version as a read just now found it (the follower's, for every shard it
        holds), taken for the first attempt instead of a read of its own.
        """
        delay = self.spec.replay_backoff_initial
        attempt = 0
        while True:
            attempt += 1
            try:
                target = known if known is not None else await self.ledger().current()
                known = None  # an attempt after this one reads the ledger again
                self.note_current(target)
                ack = await self.apply(unit, target)
                async with self.lock:
                    now = await self.ledger().current()
                    if (now.version if now else self.spec.initial_version) == ack.version:
                        await self.record_ack(unit, ack)
                        return
                self.note_current(now)
                log.info(
                    "policy.replay_overtaken",
                    unit=unit.name,
                    replayed=ack.version,
                    current=self.current_version,
                )
                continue
            except (PolicyError, EtcdError) as exc:
                error = str(exc)
            await self._record_failure(unit, error)
            self.engine.transition(
                unit,
                UnitState.HELD,
                f"held: replay attempt {attempt} failed: {error}; retrying in {delay:.1f}s",
            )
            log.warning("policy.replay_failed", unit=unit.name, attempt=attempt, error=error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.spec.replay_backoff_max)

    def _claimer_gone(self, shard: str, claim: Claim) -> None:
        """The process that paused `shard` exited before anyone resumed it: nobody will,
        and it may have sent half the step's weights. Rejoin it."""
        unit = self.engine.units.get(shard)
        if unit is None or not unit.state.running:
            return
        self.event("shard.pause_orphaned", shard, pid=claim.pid, why=claim.why)
        self.rejoin(unit, f"paused by pid {claim.pid} ({claim.why}), which exited before "
                          "resuming it: replaying the current policy")  # fmt: skip

    def rejoin(self, unit: Unit, reason: str) -> None:
        """Hold a live shard, replay the current version into it and admit it again (the
        cluster's membership: a shard whose node was lost and is back)."""
        self._start_rejoin(unit, reason)

    def _start_rejoin(
        self, unit: Unit, reason: str, known: PolicyVersion | None = None
    ) -> None:
        """A live shard went stale: hold it and replay in the background, then admit
        (`known`: the current version, just read, as for `_catch_up`)."""
        if unit.name in self._rejoins or not unit.state.running:
            return
        self.engine.hold(unit, f"held: {reason}")

        async def rejoin() -> None:
            await self._catch_up(unit, known)
            self._rejoins.pop(unit.name, None)
            if unit.hold_reason is not None and unit.state.running:
                self.engine.admit(unit, self._ack_detail(unit))

        self._rejoins[unit.name] = asyncio.get_running_loop().create_task(rejoin())

    def note_current(self, current: PolicyVersion | None) -> None:
        self._noted = current
        self.current_version = current.version if current else self.spec.initial_version
        for name in self.shard_names:
            self._shard_policy(name).current = self.current_version

    def _ack_detail(self, unit: Unit) -> str:
        shard = self.shard_policy(unit)
        ms = shard.last_ack_ms
        steps = ", ".join(f"{k} {v:.0f}" for k, v in ms.items())
        return (
            f"at policy version {shard.version} (last update {sum(ms.values()):.0f} ms: {steps})"
        )

    # ------------------------------------------------------------------ what it knows

    def _shard_policy(self, name: str) -> ShardPolicy:
        """The shard's record, to write (the only way to)."""
        return self._shards.setdefault(name, ShardPolicy())

    def shard_policy(self, unit: Unit) -> ShardPolicy:
        """The shard's record, to read (a blank one before anything is known)."""
        return self._shards.get(unit.name) or ShardPolicy()

    def shard_version(self, unit: Unit) -> int | None:
        """The version the shard holds, verified (None: none since it (re)started)."""
        return self.shard_policy(unit).version

    def note_error(self, unit: Unit, error: str) -> None:
        self._shard_policy(unit.name).last_error = error

    def event(self, kind: str, unit: str | None, **fields: Any) -> None:
        if self.host is not None:
            self.host.events.emit(kind, unit, **fields)

    def unit_status(self, unit: Unit) -> ExtensionUnitStatus:
        shard = self._shards.get(unit.name)
        status = shard.as_status() if shard else {}
        claims = self.claims.of(unit.name)
        if claims and "policy" in status:
            status["policy"]["paused_by"] = claims
        status.update(self.spares.unit_status(unit))
        return status

    # ------------------------------------------------------------------ one shard

    async def call(self, unit: Unit, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        worker = worker_of(unit.spec)
        assert worker is not None
        try:
            reply = await dynamo.engine_call(
                self.session,
                worker.system_url,
                route,
                payload,
                timeout_s=self.spec.call_timeout,
            )
        except (dynamo.EngineRouteError, dynamo.DynamoHTTPError) as exc:
            raise ShardError(unit.name, route, str(exc)) from None
        if reply.get("status") != "ok":
            raise ShardError(unit.name, route, reply.get("message") or json.dumps(reply)[:300])
        if route == "resume_generation":  # dynamod resumed it: no outside pause holds
            self.claims.ended(unit.name)
        return reply

    async def apply(self, unit: Unit, target: PolicyVersion | None) -> ShardAck:
        """Bring one shard to `target` (None: the boot weights at initial_version), reset its
        KV cache, verify, taint and resume it. The shard stays paused if any step fails.

        With `[policy] max_updating = N`, at most N of this node's shards apply at once (a
        push's, a replay's, a spare's); the rest wait their turn before the pause, so a
        serving shard serves on while it waits. Every update on a node shares its cores
        (or its disk and host memory): 32 shards of one node updating at once on two cores
        failed their liveness probes and were restarted in the middle of the push."""
        slots, asked = self.update_slots, time.monotonic()
        waits = slots.would_wait()
        said = waits and unit.hold_reason is not None
        if waits:
            log.info("policy.update_slot_wait", unit=unit.name, updating=slots.holders,
                     waiting=len(slots.waiting) + 1)  # fmt: skip
        if said:  # a held shard says why it waits; a serving one's detail stays what it is
            self.engine.set_detail(
                unit, f"{unit.hold_reason}; waiting for an update slot ({slots.describe()})"
            )
        await slots.take(unit.name)
        waited = (time.monotonic() - asked) * 1000
        if said and unit.hold_reason is not None:  # its turn: the wait is over
            self.engine.set_detail(unit, unit.hold_reason)
        try:
            ack = await self._apply(unit, target)
        finally:
            slots.give_back(unit.name)
        ack.waited_ms = waited
        return ack

    async def _step(
        self, unit: Unit, timings: dict[str, float], name: str, route: str,
        payload: dict[str, Any],
    ) -> dict[str, Any]:
        """One step of an update on `unit`, sent again where `send_again` says so; its
        milliseconds added to `timings[name]`."""
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = await self.call(unit, route, payload)
                break
            except ShardError as exc:
                if not send_again(route, exc.detail, time.monotonic() - started):
                    raise
                log.warning("policy.step_retried", unit=unit.name, step=name,
                            attempt=attempt, error=exc.detail[:300])  # fmt: skip
                await asyncio.sleep(_TAINT_RETRY_S)
        timings[name] = timings.get(name, 0.0) + (time.monotonic() - started) * 1000
        return reply

    async def _apply(self, unit: Unit, target: PolicyVersion | None) -> ShardAck:
        timings: dict[str, float] = {}
        step = functools.partial(self._step, unit, timings)
        await step("pause", "pause_generation", {})
        if target is not None and ADMIT_WITHOUT_REPLAY and self.shard_version(unit) is None:
            log.warning("policy.admit_without_replay", unit=unit.name, version=target.version)
            await step("taint", "update/model_taints",
                       {"taints": [f"{self.spec.taint_prefix}{target.version}"]})
            await step("resume", "resume_generation", {})
            return ShardAck(unit.name, target.version, target.digest, timings)
        if target is None:
            version, digest = self.spec.initial_version, None
            await step("load", "set_weight_version", {"weight_version": version})
        elif await self._holds_published(unit, step, target):
            version, digest = target.version, target.digest
        else:
            version, digest = target.version, target.digest
            await on_this_node(target)
            loaded = await step(
                "load",
                "update_weights_from_disk",
                {"model_path": target.path, "weight_version": version},
            )
            if digest and loaded.get("digest") and loaded["digest"] != digest:
                raise ShardError(
                    unit.name,
                    "update_weights_from_disk",
                    f"loaded digest {loaded['digest']} != ledger digest {digest}",
                )
        await step("kv_reset", "flush_cache", {})
        seen = await step("verify", "get_weight_version", {})
        if seen.get("version") != version:
            raise ShardError(
                unit.name,
                "verify",
                f"shard reports version {seen.get('version')!r}, expected {version}",
            )
        if digest and seen.get("digest") and seen["digest"] != digest:
            raise ShardError(
                unit.name, "verify", f"shard reports digest {seen['digest']}, ledger has {digest}"
            )
        taints, own = self.routing_taints(unit, version)
        await step("taint", "update/model_taints", {"taints": [*taints, *own]})
        await step("resume", "resume_generation", {})
        if taints:  # a spare holds no version taint, so no version traffic is routed to it
            started = time.monotonic()
            await self.routed(unit, version)
            timings["route"] = (time.monotonic() - started) * 1000
        return ShardAck(unit.name, version, seen.get("digest"), timings)

    async def _holds_published(
        self,
        unit: Unit,
        step: Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]],
        target: PolicyVersion,
    ) -> bool:
        """Whether the shard holds a published step already, so that no load is needed:
        on a cluster, the trainer's ranks on the shard's own node fed it (verl's colocated
        path) while another node's dynamod published it. It must report the step's version
        and the ledger's digest (what the trainer's acknowledgements agreed on); a pushed
        step, a step without a digest or any other answer loads the checkpoint."""
        if target.how != "publish" or not target.digest:
            return False
        seen = await step("check", "get_weight_version", {})
        if seen.get("version") != target.version or seen.get("digest") != target.digest:
            return False
        log.info("policy.holds_published", unit=unit.name, version=target.version,
                 digest=target.digest)  # fmt: skip
        return True

    def _frontend(self) -> tuple[str, str] | None:
        """(url, model) of a ready Dynamo frontend of this stack, or None."""
        for other in self.engine.units.values():
            probe = other.spec.ready
            if isinstance(probe, DynamoFrontendProbe) and other.state is UnitState.READY:
                return probe.url, probe.model
        return None

    async def _await_routed(
        self, unit: Unit, version: int, taints: list[str], instances: set[int]
    ) -> None:
        """Done only when the router routes this version's traffic to this shard: a canary
        that requires the version's taint and the shard's own instance taint must be served
        by that shard (`extra_fields` worker_id). After an etcd restart the frontend's view
        lags the taints by seconds; until then the canary fails and `status` says so. No
        ready frontend: nothing routes anything, so nothing to wait for."""
        frontend = self._frontend()
        if frontend is None or not instances:
            self._shard_policy(unit.name).routed_version = None
            return
        url, model = frontend
        body = {
            "model": model,
            "prompt": "dynamod route check",
            "max_tokens": 1,
            "nvext": {
                "routing_constraints": {"required_taints": taints},
                "extra_fields": ["worker_id"],
            },
        }
        began = time.monotonic()
        deadline = began + self.spec.route_timeout
        waiting = f"waiting for the router to route policy v{version} to {unit.name}"
        self.engine.transition(unit, unit.state, f"{waiting} ({taints[0]})")
        last = "no canary answered yet"
        retry: float | None = None
        while True:
            try:
                # The canary can only be served by this shard (its own instance taint), so
                # one that reached it is waited for: a real engine's first generation after
                # a start takes tens of seconds on a CPU, and a canary cut off at 5 s and
                # sent again kept a promoted spare out of service for 32 s (real-engine.md).
                wait = max(_ROUTE_ATTEMPT_S, deadline - time.monotonic())
                async with self.session.post(
                    f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=wait)
                ) as resp:
                    text = await resp.text()
                if resp.status == 200:
                    served = (json.loads(text).get("nvext") or {}).get("worker_id") or {}
                    if served.get("decode_worker_id") in instances:
                        self._shard_policy(unit.name).routed_version = version
                        return
                    last = f"served by {served} instead"
                else:
                    last = f"HTTP {resp.status}: {text[:160]}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ShardError(
                    unit.name,
                    "route",
                    f"the router did not route policy v{version} to it within"
                    f" {self.spec.route_timeout:g}s (last canary: {last})",
                )
            self.engine.transition(unit, unit.state, f"{waiting}; last canary: {last}")
            retry = route_retry(retry, time.monotonic() - began)
            await asyncio.sleep(retry)

    async def warm(self, unit: Unit) -> float | None:
        """One 1-token generation pinned to the shard's own instance (`backend_instance_id`)
        through the frontend: a spare serves nothing until it is promoted, and a real
        engine's first generation takes tens of seconds, which would otherwise fall on the
        promotion's canary. Not trainer traffic; the ms it took, None with no frontend."""
        frontend = self._frontend()
        instances = self.registrations.instance_ids(unit)
        if frontend is None or not instances:
            return None
        url, model = frontend
        body = {
            "model": model,
            "prompt": "dynamod warm-up",
            "max_tokens": 1,
            "nvext": {"backend_instance_id": instances[0]},
        }
        started = time.monotonic()
        try:
            async with self.session.post(
                f"{url}/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.spec.route_timeout),
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ShardError(unit.name, "warm", f"{type(exc).__name__}: {exc}") from None
        if resp.status != 200:
            raise ShardError(unit.name, "warm", f"HTTP {resp.status}: {text[:160]}")
        return (time.monotonic() - started) * 1000

    async def record_ack(self, unit: Unit, ack: ShardAck) -> None:
        await self.record_acks([(unit, ack)])

    async def record_acks(self, acked: Sequence[tuple[Unit, ShardAck]]) -> None:
        """Each shard holds its ack's version: its ShardPolicy, and a serving shard's
        record in the ledger, all of them in one write."""
        await self._hold_acks(acked, self._ledger_records(acked))

    def _ledger_records(self, acked: Sequence[tuple[Unit, ShardAck]]) -> list[ShardRecord]:
        """The ledger's records of the serving shards among `acked` (a spare holds the
        version untainted: it is not admitted, and has none)."""
        at = time.time()
        return [
            ShardRecord(self.ledger_name(unit.name), ack.version, ack.digest, at, None)
            for unit, ack in acked
            if not self.spares.is_spare(unit)
        ]

    async def _hold_acks(
        self, acked: Sequence[tuple[Unit, ShardAck]], unwritten: Sequence[ShardRecord]
    ) -> None:
        """Each shard's ShardPolicy (or its spare's record) holds its ack, and `unwritten`
        (the serving shards' ledger records not yet written) go in one write; a failed
        write leaves the ledger's records behind, not the acks."""
        serving = []
        for unit, ack in acked:
            spare = self.spares.is_spare(unit)
            self._shard_policy(unit.name).acknowledged(
                ack, current=self.current_version, admitted=not spare
            )
            if spare:
                self.spares.recorded(unit, ack)
            else:
                serving.append(unit)
        if unwritten:
            with contextlib.suppress(EtcdError):
                await self.ledger().record_shards(unwritten)
        for unit in serving:
            self.engine.transition(unit, unit.state, self._ack_detail(unit))

    async def _record_failure(self, unit: Unit, error: str) -> None:
        shard = self._shard_policy(unit.name)
        shard.admitted, shard.last_error = False, error
        with contextlib.suppress(EtcdError):
            old = await self.ledger().shard(self.ledger_name(unit.name))
            await self.ledger().record_shards([
                ShardRecord(
                    self.ledger_name(unit.name),
                    old.applied_version if old else None,
                    old.digest if old else None,
                    old.acked_at if old else None,
                    error,
                )
            ])  # fmt: skip

    # ------------------------------------------------------------------ push / publish

    def admitted_shards(self) -> list[Unit]:
        """Shards in service: running, past readiness, and not held (a held shard can also
        be degraded while its liveness probe fails; it is still not admitted)."""
        return [
            unit
            for unit in (self.engine.units[n] for n in policy_table.shards(self.engine.stack))
            if unit.state in {UnitState.READY, UnitState.DEGRADED}
            and unit.hold_reason is None
            and self.spares.is_serving(unit)
        ]

    async def push(self, step: int, path: str, serving: int | None = None) -> dict[str, Any]:
        """Load `path` as `step` into every admitted shard; the ledger advances once they
        acknowledged (and, multi-node, the answer waits for the other nodes' shards).
        `serving = K`: K of this node's shards update first, alone, and the answer goes
        once they serve the step and the ledger advanced; the rest start after it (the
        policy lock held until they are done) and the other nodes replay the step
        meanwhile. Trainer traffic requires the step's taint, so it reaches only the
        shards that serve it."""
        started = time.monotonic()
        checkpoint = Path(path).absolute()
        check_checkpoint(checkpoint)
        await self.lock.acquire()
        rest: asyncio.Task[None] | None = None
        acks = Acks()
        updates: Updates | None = None
        try:
            current, history = await self.ledger().versions()  # the commit reads nothing
            if current is not None and step < current.version:
                raise PolicyError(
                    f"step {step} is older than the current policy version "
                    f"{current.version}; pushes must move forward"
                )
            if current is not None and step == current.version:
                return await self._already_committed(current, str(checkpoint), started)
            shards = self._push_shards(serving)
            target = PolicyVersion(step, str(checkpoint), None, time.time(), "push")
            log.info("policy.push_started", version=step, shards=[u.name for u in shards],
                     serving=serving)  # fmt: skip
            loop = asyncio.get_running_loop()
            # with `serving`: those K first, the rest once the answer's commit is through
            updates = Updates({u.name: functools.partial(self.apply, u, target) for u in shards},
                              serving)  # fmt: skip
            acks = await collect(updates.tasks, serving or len(shards), PolicyError)
            if not acks.good:
                await self._resume_after_failed_push(shards)
                raise PolicyError(
                    f"push of step {step} from {checkpoint} failed on every shard; the ledger "
                    f"stays at {current.version if current else 'its initial version'}: "
                    + "; ".join(acks.bad.values())
                )
            committing = Stopwatch()
            target = await self._commit_push(target, acks.good, history)
            commit = committing.spent()
            updates.go()
            if acks.pending:
                rest = loop.create_task(self._finish_push(target, acks.pending, started))
                self._push_rest = (rest, acks.pending)
        finally:
            if updates is not None and rest is None:
                updates.drop()  # no answer: the shards still waiting their turn stay as they are
            if rest is None:
                await self._settle_pending(acks.pending)
                self.lock.release()
        answered = {a.shard: a.as_dict() for a in acks.good}
        answered.update({s: {"ok": False, "error": e} for s, e in acks.bad.items()})
        answer = await self._committed(
            "pushed", target, answered, acks.bad, started, updating=sorted(acks.pending.values())
        )
        answer.update(commit.as_dict("commit"))  # the ledger's advance and the acks' records
        return answer

    def _push_shards(self, serving: int | None) -> list[Unit]:
        """The shards a push updates: every admitted one, if there are enough of them."""
        shards = self.admitted_shards()
        if not shards or len(shards) < self.spec.min_ready_shards:
            raise PolicyError(
                f"only {len(shards)} shard(s) admitted, fewer than min_ready_shards="
                f"{self.spec.min_ready_shards}; the push would leave too few serving "
                "(held shards: " + ", ".join(self.summary()["held"]) + ")"
            )
        if serving is not None and not 1 <= serving <= len(shards):
            raise PolicyError(
                f"serving={serving}: the push can answer once 1 to {len(shards)} shard(s)"
                f" serve the step, the {len(shards)} admitted on this node"
            )
        return shards

    async def _commit_push(
        self, target: PolicyVersion, good: list[ShardAck], history: list[PolicyVersion]
    ) -> PolicyVersion:
        """The ledger advances to the step the `good` shards acknowledged (with their
        digest) and records them, in one write (`history`: the ledger's, as the push
        read it). It was three round trips to etcd (the history's read, the advance, the
        records): 16-33 ms of the answer at 8 nodes x 32 shards (docs/benchmarks.md 16)."""
        digests = {a.digest for a in good if a.digest}
        target = PolicyVersion(
            target.version, target.path, next(iter(digests), None), target.published_at, "push"
        )
        acked = [(self.engine.units[ack.shard], ack) for ack in good]
        # the records that did not fit in the advance's transaction come back (~100 shards)
        left = await self.ledger().advance(
            target, self.spec.keep, self._ledger_records(acked), history
        )
        self.note_current(target)
        await self._hold_acks(acked, left)
        return target

    async def _settle_pending(self, pending: Mapping[asyncio.Task[ShardAck], str]) -> None:
        """A push that failed before its answer with shards still updating (the ledger's
        write failed): they finish as every shard of a push without `serving` would have."""
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _finish_push(
        self,
        target: PolicyVersion,
        pending: dict[asyncio.Task[ShardAck], str],
        started: float,
    ) -> None:
        """The rest of a push answered early (`serving`): once every shard still updating
        has answered, those that acknowledged are recorded in one write (a digest other
        than the committed one is stale, not recorded), then the policy lock is let go, a
        failed shard is held and replayed, and the push's whole time is logged
        (`policy.push_finished`: `seconds`, the other nodes' shards included; `here_s`,
        this node's)."""
        try:
            acks = await collect(pending, len(pending), PolicyError)
            here = round(time.monotonic() - started, 3)  # this node's shards, all of them
            for ack in acks.good:
                if target.digest and ack.digest and ack.digest != target.digest:
                    acks.bad[ack.shard] = (
                        f"loaded digest {ack.digest}, the committed step's {target.digest}"
                    )
            await self.record_acks([
                (self.engine.units[ack.shard], ack) for ack in acks.good
                if ack.shard not in acks.bad
            ])  # fmt: skip
        except Exception as exc:  # a background task's failure is logged, not raised
            log.error("policy.push_finish_failed", version=target.version, error=repr(exc))
            return
        finally:
            self._push_rest = None
            self.lock.release()
        await self._give_up(acks.bad, "pushed", target.version)
        self.spares.refresh()
        others = await self.after_commit(target.version) if self.after_commit is not None else {}
        seconds = round(time.monotonic() - started, 3)
        updated = sorted(a.shard for a in acks.good if a.shard not in acks.bad)
        behind = others.get("behind", [])
        log.info("policy.push_finished", version=target.version, seconds=seconds,
                 here_s=here, updated=updated, stale=sorted(acks.bad), behind=behind)  # fmt: skip
        self.event("policy.push_finished", None, version=target.version, seconds=seconds,
                   here_s=here, updated=updated, stale=sorted(acks.bad), behind=behind)  # fmt: skip

    async def _already_committed(
        self, current: PolicyVersion, path: str, started: float
    ) -> dict[str, Any]:
        """A push of the committed step again (its reply was lost, e.g. the daemon died
        after committing): a no-op that answers what was committed. Step directories are
        immutable, so the same step from the same path is the same weights; the same step
        from elsewhere is refused rather than silently ignored."""
        if current.path != path:
            raise PolicyError(
                f"step {current.version} is already committed from {current.path}"
                f" (digest {current.digest}); a push of the same step must carry the same"
                f" weights, not {path}; push step {current.version + 1} for new ones"
            )
        records = await self.ledger().shards()
        acks = {
            name: {"ok": True, "already": True, "version": records[key].applied_version}
            for name in policy_table.shards(self.engine.stack)
            if (key := self.ledger_name(name)) in records
            and records[key].applied_version == current.version
        }
        answer = {
            "ok": True,
            "already_committed": True,
            "version": current.version,
            "path": current.path,
            "digest": current.digest,
            "acks": acks,
            "stale": sorted(n for n in policy_table.shards(self.engine.stack) if n not in acks),
            "seconds": round(time.monotonic() - started, 3),
        }
        log.info("policy.push_already_committed", version=current.version, path=path)
        return answer

    def _not_reached(self, version: int, reached: AbstractSet[str]) -> dict[str, str]:
        """Every shard the step did not reach (restarting, stopped, a spare), with what
        happens to it: a push's answer names every shard of the stack (`reached`: acked,
        stale, or still updating)."""
        out: dict[str, str] = {}
        for name in policy_table.shards(self.engine.stack):
            if name in reached:
                continue
            unit = self.engine.units[name]
            if self.spares.role(unit) is Role.SPARE:
                out[name] = f"spare: caught up to version {version} before it is promoted"
            else:
                out[name] = (f"{unit.state}: not serving now; replayed to version {version}"
                             " and verified before it serves")
        return out

    async def _resume_after_failed_push(self, shards: list[Unit]) -> None:
        """Nothing took the new weights: every shard still holds the current version, so
        it goes back to serving rather than staying paused."""
        for unit in shards:
            with contextlib.suppress(PolicyError):
                await self.call(unit, "resume_generation", {})

    async def publish(
        self, step: int, path: str, acks: Mapping[str, str | None] | None = None
    ) -> dict[str, Any]:
        """The trainer loaded `step` into the shards itself (`path`: where a replay loads it
        from). With `acks` (shard, named as the ledger names it, -> the digest it computed
        from the trainer's transfer), an admitted shard without one missed the update, and
        one whose digest differs from the others' (or from what it reports) is stale; the
        agreed digest is the ledger's. Each shard of this node that passes is tainted with
        the step, resumed and router-verified; on a cluster the other nodes' daemons follow
        the ledger (`_holds_published`: no load where their own node's ranks fed the step)
        and the answer waits for them."""
        started = time.monotonic()
        digest = agreed_digest(acks)
        async with self.lock:
            ledger = self.ledger()
            current, history = await ledger.versions()  # the advance reads nothing
            if current is not None and step < current.version:
                raise PolicyError(
                    f"step {step} is older than the current policy version "
                    f"{current.version}; publishes must move forward"
                )
            target = PolicyVersion(
                step, str(Path(path).absolute()), digest, time.time(), "publish"
            )
            await ledger.advance(target, self.spec.keep, history=history)
            self.note_current(target)
            shards = self.admitted_shards()
            results = await asyncio.gather(
                *(self._verify_published(u, step, digest, acks) for u in shards),
                return_exceptions=True,
            )
            answers: dict[str, Any] = {}
            stale: dict[str, str] = {}
            acked: list[tuple[Unit, ShardAck]] = []
            unexpected: BaseException | None = None
            for unit, result in zip(shards, results, strict=True):
                if isinstance(result, ShardAck):
                    answers[unit.name] = result.as_dict()
                    acked.append((unit, result))
                elif isinstance(result, PolicyError):
                    stale[unit.name] = str(result)
                    answers[unit.name] = {"ok": False, "error": str(result)}
                else:
                    unexpected = unexpected or result
            # every acknowledging shard's record in one write, not one a shard on the
            # answer's way (32 of them a node at 32 shards)
            await self.record_acks(acked)
            if unexpected is not None:
                raise unexpected
        return await self._committed("published", target, answers, stale, started)

    async def _committed(
        self,
        how: str,
        target: PolicyVersion,
        acks: dict[str, Any],
        stale: dict[str, str],
        started: float,
        updating: list[str] | None = None,
    ) -> dict[str, Any]:
        """After a push or a publish committed `target`: each shard that did not take it
        is given up (`_give_up`); the spares are brought along; other nodes are awaited
        (`after_commit`), unless shards of this node are still `updating` (a push answered
        early: the other nodes replay meanwhile); then the answer."""
        await self._give_up(stale, how, target.version)
        self.spares.refresh()
        others: dict[str, Any] = {}
        if self.after_commit is not None and not updating:
            others = await self.after_commit(target.version)
        answer = {
            "ok": True,
            "version": target.version,
            "path": target.path,
            "digest": target.digest,
            "acks": acks,
            "stale": sorted(stale),
            **others,
            "seconds": round(time.monotonic() - started, 3),
        }
        if updating:
            answer["updating"] = updating
        away = self._not_reached(target.version, {*acks, *stale, *(updating or ())})
        if away:
            answer["not_pushed"] = away
        log.info(
            f"policy.{how}",
            version=target.version,
            seconds=answer["seconds"],
            acks={k: v.get("total_ms", v.get("error")) for k, v in acks.items()},
            updating=updating or [],
        )
        self.event(
            f"policy.{how}",
            None,
            version=target.version,
            seconds=answer["seconds"],
            acked=sorted(n for n, a in acks.items() if a.get("ok", True)),
            stale=answer["stale"],
        )
        return answer

    async def _give_up(self, stale: Mapping[str, str], how: str, version: int) -> None:
        """Each shard that did not take the step is recorded, given up as a spare
        candidate and sent to rejoin (held, the ledger's version replayed, admitted)."""
        for name, error in stale.items():
            unit = self.engine.units[name]
            await self._record_failure(unit, error)
            self.spares.lost(unit, Reason.VERIFICATION, error)
            self._start_rejoin(unit, f"stale after the {how} step {version}: {error}")

    async def _verify_published(
        self, unit: Unit, step: int, digest: str | None, acks: Mapping[str, str | None] | None
    ) -> ShardAck:
        timings: dict[str, float] = {}
        named = self.ledger_name(unit.name)  # as the trainer names it: <node>/<unit> on a cluster
        if acks is not None and named not in acks:
            raise ShardError(
                unit.name, "acknowledge", "missed the update: the trainer has no acknowledgement"
            )
        acked = acks.get(named) if acks is not None else None
        if digest and acked and acked != digest:
            raise ShardError(
                unit.name, "acknowledge", f"acknowledged digest {acked}, the others {digest}"
            )
        started = time.monotonic()
        seen = await self.call(unit, "get_weight_version", {})
        timings["verify"] = (time.monotonic() - started) * 1000
        if seen.get("version") != step:
            raise ShardError(unit.name, "verify", f"shard reports version {seen.get('version')!r}")
        if acked and seen.get("digest") and seen["digest"] != acked:
            raise ShardError(
                unit.name, "verify", f"shard reports digest {seen['digest']}, acknowledged {acked}"
            )
        taints = self.spares.taints(unit, step)
        instance_ids = self.registrations.instance_ids(unit)
        own = [f"{_INSTANCE_TAINT}{i:x}" for i in instance_ids]
        for name, route, body in (
            ("taint", "update/model_taints", {"taints": [*taints, *own]}),
            ("resume", "resume_generation", {}),
        ):
            started = time.monotonic()
            await self.call(unit, route, body)
            timings[name] = (time.monotonic() - started) * 1000
        if taints:
            started = time.monotonic()
            await self._await_routed(unit, step, [*taints, *own[:1]], set(instance_ids))
            timings["route"] = (time.monotonic() - started) * 1000
        return ShardAck(unit.name, step, seen.get("digest") or acked, timings)

    async def status_full(self) -> dict[str, Any]:
        ledger = self.ledger()
        current, history = await ledger.versions()
        records = await ledger.shards()
        admitted = {u.name for u in self.admitted_shards()}
        shards = []
        for name in policy_table.shards(self.engine.stack):
            unit = self.engine.units[name]
            record = records.get(self.ledger_name(name))
            shards.append(
                {
                    "name": name,
                    "state": str(unit.state),
                    "policy_version": self.shard_version(unit),
                    "admitted": name in admitted,
                    "role": str(self.spares.role(unit)),
                    "last_ack": record.acked_at if record else None,
                    "last_error": record.last_error if record else None,
                }
            )
        return {
            "store": self.spec.store,
            "current": current.version if current else self.spec.initial_version,
            "initial": current is None,
            "current_path": current.path if current else None,
            "current_digest": current.digest if current else None,
            "history": [{"version": v.version, "path": v.path, "how": v.how} for v in history],
            "shards": shards,
        }

    def summary(self) -> dict[str, Any]:
        """Cheap, synchronous view for `status --json` (no ledger round trip)."""
        shards = policy_table.shards(self.engine.stack)
        admitted = len(self.admitted_shards())
        return {
            "current": self.current_version,
            "admitted": admitted,
            "min_ready_shards": self.spec.min_ready_shards,
            "serving": admitted >= max(1, self.spec.min_ready_shards),
            "held": [n for n in shards if self.engine.units[n].hold_reason is not None],
            # paused by a process outside dynamod (verl), until dynamod or it resumes them
            "paused_outside": self.claims.claimed(),
            "spares": self.spares.summary(),
            "update_slots": (
                self.update_slots.as_dict() if self.update_slots.limit is not None else None
            ),
            # a push answered early (`serving`): its shards still updating
            "updating": sorted(
                n for t, n in (self._push_rest[1] if self._push_rest else {}).items()
                if not t.done()
            ),
        }

    # ------------------------------------------------------------------ across nodes

    def ledger_name(self, unit: str) -> str:
        """The shard's name in the ledger: `<node>/<unit>` in a cluster stack, where every
        node has a `worker@0`; the unit's own name on a single node."""
        cluster = self.engine.stack.cluster
        return f"{cluster.node}/{unit}" if cluster is not None else unit

    async def follow_ledger(self, read: tuple[PolicyVersion | None] | None = None) -> int | None:
        """Bring this node's admitted shards to the ledger's current version when another
        node's push moved it on: each is held and replays it (pause, load, flush, verify,
        taint, resume), then admitted again. `read`: the current version as a read just
        now found it (`ledger_read`), else the ledger is read. Returns the ledger's version
        (None: never set)."""
        if self.lock.locked():  # a push or an admission here: it reads the ledger itself
            return self.current_version
        current = read[0] if read is not None else await self.ledger().current()
        if current is None or current == self._noted:
            return current.version if current else None
        version, again = current.version, current.version == self.current_version
        self.note_current(current)
        for unit in self.admitted_shards():
            if self.shard_version(unit) != version:
                self._start_rejoin(
                    unit, f"behind the ledger, which is at version {version}", current
                )
            elif again and not self._holds_record(unit, current):
                self._start_rejoin(unit, (
                    f"the ledger's version {version} is a new {current.how} "
                    f"(digest {current.digest}), not what it was admitted with"), current)
        return version

    def _holds_record(self, unit: Unit, record: PolicyVersion) -> bool:
        """Whether a shard at `record`'s version number holds `record` itself and needs
        nothing: its verified digest is a pushed record's. A new record at the version this
        node already holds is the first at the initial version (the shards hold the boot
        weights), or the same step again. A published one is never held: the trainer's
        ranks on this node paused the shards they fed (their weights may be the boot
        weights, as verl's step 0 is), and only the replay's check resumes them."""
        digest = self.shard_policy(unit).digest
        return record.how != "publish" and record.digest is not None and digest == record.digest

    # ------------------------------------------------------------------ taints

    def routing_taints(self, unit: Unit, version: int) -> tuple[list[str], list[str]]:
        """(the version's taint, none for a spare; the shard's own instance taints)."""
        instance_ids = self.registrations.instance_ids(unit)
        return self.spares.taints(unit, version), [f"{_INSTANCE_TAINT}{i:x}" for i in instance_ids]

    async def routed(self, unit: Unit, version: int) -> None:
        """Until a canary with this version's taint reaches the shard through the frontend."""
        taints, own = self.routing_taints(unit, version)
        instance_ids = set(self.registrations.instance_ids(unit))
        await self._await_routed(unit, version, [*taints, *own[:1]], instance_ids)
