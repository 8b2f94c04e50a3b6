"""Admission, pause, weights and the RL admin routes of one CPU rollout worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.workers.cpu.admission_mode import Event, Mode, after
from dynamod.workers.cpu.engine import Engine
from dynamod.workers.cpu.errors import WorkerError, engine_shutdown
from dynamod.workers.weights import CheckpointError, WeightSet, load_checkpoint

log = logging.getLogger("dynamod.workers.cpu")

PAUSE_MODES = ("keep", "wait", "abort")
PAUSE_REQUIRED = (
    "Worker must be paused via pause_generation() before updating weights. "
    "Call pause_generation() first, then update, then resume_generation()."
)
NOT_AN_OBJECT = {"status": "error", "message": "request body must be a JSON object"}
SLEEP_LEVELS = (1, 2)
ASLEEP = "Engine is sleeping; call control/wake_up before updating weights"
# how often the worker looks whether its running engine can still be reached
REACHABLE_CHECK_S = 1.0

RouteHandler = Callable[[Any], Awaitable[dict[str, Any]]]


_END = object()
_ABORTED = object()
# What an aborted request ends with; Dynamo's name for vLLM's "abort" finish reason.
CANCELLED_CHUNK: dict[str, Any] = {"token_ids": [], "index": 0, "finish_reason": "cancelled"}


@dataclass(eq=False)
class _Flight:
    """One admitted request: its engine stream is pumped into `chunks` by `pump`."""

    version: Any
    digest: str
    probe: bool
    chunks: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    pump: asyncio.Task[None] | None = None
    aborted: bool = False
    request_id: str | None = None  # the frontend's id for it (Dynamo's Context.id())
    in_engine: bool = True  # counted in CpuWorker._pumping until it leaves the engine


class CpuWorker:
    """Admission, weights and the RL admin routes of one CPU rollout worker.

    One lock serialises pause, resume, flush and weight updates, as upstream's
    `_pause_lock` does, so a resume can never interleave with an update.
    """

    def __init__(
        self,
        engine: Engine,
        weights: WeightSet,
        version: Any = None,
        version_declared: bool = False,
        drain_timeout: float = 60.0,
        serve_previous_weights: bool = False,
        start_paused: bool = False,
    ) -> None:
        self.engine = engine
        self.weights = weights
        self.version = version
        self.version_declared = version_declared
        self.drain_timeout = drain_timeout
        # Test only: the engine keeps generating with the weights of the update before,
        # while the version and digest reported are the new ones (a stale shard that lies).
        self.serve_previous_weights = serve_previous_weights
        self.instance_id: int | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        # New requests wait at admission. A supervised worker starts so: it registers
        # with Dynamo before dynamod can hold it, and must not serve its boot weights to
        # whatever the router sends it meanwhile; the rejoin's resume admits it.
        self._mode = Mode.PAUSED if start_paused else Mode.OPEN
        self._swapping = False  # the engine is being replaced; nothing enters it
        self._flights: set[_Flight] = set()
        self._pumping = 0  # requests still inside the engine
        # whether any request entered the engine since it was started: one that served
        # nothing holds no cached block, and a flush keeps it
        self._engine_used = False

    # ----------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[Any]:
        from dynamo.common.backend.health_check import HEALTH_CHECK_KEY, is_probe

        probe = is_probe(request)
        if probe:
            request = {k: v for k, v in request.items() if k != HEALTH_CHECK_KEY}
        flight = await self._admit(probe)
        with contextlib.suppress(Exception):
            flight.request_id = str(context.id()) if context is not None else None
        flight.pump = asyncio.create_task(self._pump(request, flight))
        try:
            while True:
                chunk = await flight.chunks.get()
                if chunk is _END:
                    return
                if chunk is _ABORTED:
                    yield CANCELLED_CHUNK
                    return
                if isinstance(chunk, BaseException):
                    raise engine_shutdown(f"engine failed: {chunk}") from chunk
                if not probe and not await self._wait_output_allowed(flight):
                    yield CANCELLED_CHUNK
                    return
                yield self._annotate(chunk, flight)
        finally:
            flight.pump.cancel()
            # A pump cancelled before it ran never reaches its own `finally`.
            await self._left_engine(flight)
            async with self._changed:
                self._flights.discard(flight)
                self._changed.notify_all()

    async def _enter(self, event: Event) -> None:
        """Change the admission mode and wake whoever waits on it."""
        async with self._changed:
            self._mode = after(self._mode, event)
            self._changed.notify_all()

    async def _admit(self, probe: bool) -> _Flight:
        async with self._changed:
            # Health probes pass a pause: a paused worker is held, not unhealthy.
            await self._changed.wait_for(
                lambda: (
                    self._mode is Mode.CLOSED
                    or (not self._swapping and (probe or self._mode.admits))
                )
            )
            if self._mode is Mode.CLOSED:
                # Typed, so the frontend migrates the request to another worker.
                raise engine_shutdown("worker is shutting down")
            flight = _Flight(self.version, self.weights.digest, probe)
            self._flights.add(flight)
            self._pumping += 1
            self._engine_used = True
            return flight

    async def _pump(self, request: dict[str, Any], flight: _Flight) -> None:
        """Drain the engine stream as fast as it comes, so a held request leaves the engine."""
        try:
            async for chunk in self.engine.generate(request):
                flight.chunks.put_nowait(chunk)
            flight.chunks.put_nowait(_END)
        except asyncio.CancelledError:
            flight.chunks.put_nowait(_ABORTED if flight.aborted else _END)
            raise
        except Exception as exc:
            flight.chunks.put_nowait(exc)
        finally:
            await self._left_engine(flight)

    async def _left_engine(self, flight: _Flight) -> None:
        async with self._changed:
            if flight.in_engine:
                flight.in_engine = False
                self._pumping -= 1
                self._changed.notify_all()

    async def _wait_output_allowed(self, flight: _Flight) -> bool:
        """Wait while output is held; False when the request was aborted meanwhile."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._mode is not Mode.HOLDING or flight.aborted)
        return not flight.aborted

    def _annotate(self, chunk: Any, flight: _Flight) -> Any:
        """Say which weights and which worker produced the chunk (`nvext.engine_data`).

        `instance_id` is the worker that really served it: after a migration the
        frontend's `nvext.worker_id` still names the first worker it picked.
        """
        if isinstance(chunk, dict):
            engine_data = chunk.get("engine_data")
            engine_data = dict(engine_data) if isinstance(engine_data, dict) else {}
            engine_data["weight_version"] = flight.version
            engine_data["weight_digest"] = flight.digest
            engine_data["instance_id"] = self.instance_id
            chunk = {**chunk, "engine_data": engine_data}
        return chunk

    async def close(self) -> None:
        """Stop admitting and stop holding, so a graceful shutdown does not wait on a pause."""
        await self._enter(Event.CLOSE)

    # ------------------------------------------------------------- engine control

    async def _reset_engine(self, only_if_used: bool = False) -> bool:
        """Replace the engine once no request is inside it; admission waits meanwhile.
        `only_if_used` (a flush): keep an engine no request has entered since it was
        started, which holds no cached block and whose router view was cleared when it
        replaced the last one. A push's replay flushes right after the update built a new
        engine: on the mocker each build is a new Dynamo runtime. Whether it was replaced."""
        async with self._changed:
            if only_if_used and not self._engine_used:
                return False
            self._swapping = True
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._pumping == 0), self.drain_timeout
                )
            await self.engine.restart()
            self._engine_used = False
        except TimeoutError as exc:
            raise WorkerError(
                f"cache not flushed: {self._pumping} request(s) still in the engine "
                f"after {self.drain_timeout}s"
            ) from exc
        finally:
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()
        return True

    async def keep_reachable(self, every: float = REACHABLE_CHECK_S) -> None:
        """Build a new engine when the running one can no longer be reached: Dynamo's file
        store drops the mocker engine's instance from its private discovery when the
        worker was starved past the instance's keep-alive (32 shards a node on two cores),
        and never lists it again, so every request the engine gets fails until a reset.
        Two looks `every` s apart, the second under the admin lock (no reset of the
        routes' is then half done). Runs until cancelled."""
        missed = 0
        while True:
            await asyncio.sleep(every)
            lost = self.engine.alive and not self.engine.reachable()
            missed = missed + 1 if lost else 0
            if missed < 2:
                continue
            missed = 0
            async with self._lock:
                if not self.engine.alive or self.engine.reachable():
                    continue
                log.warning("[RL] engine %d cannot be reached (its instance left its "
                            "discovery): a new engine", self.engine.generation)  # fmt: skip
                try:
                    await self._reset_engine()
                except WorkerError as exc:
                    log.error("[RL] no new engine: %s", exc)

    async def _abort_in_flight(self) -> None:
        for flight in self._flights:
            if not flight.probe:
                flight.aborted = True
                if flight.pump is not None:
                    flight.pump.cancel()
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ admin routes

    def serialised(self, handler: RouteHandler) -> RouteHandler:
        """`handler` run under the admin lock (for routes defined elsewhere)."""

        async def locked(body: Any) -> dict[str, Any]:
            async with self._lock:
                return await handler(body)

        return locked

    def routes(self) -> dict[str, RouteHandler]:
        return {
            "liveness_probe": self.liveness_probe,
            "pause_generation": self.pause_generation,
            "resume_generation": self.resume_generation,
            "flush_cache": self.flush_cache,
            "update_weights_from_disk": self.update_weights_from_disk,
            "get_weight_version": self.get_weight_version,
            "set_weight_version": self.set_weight_version,
            "abort_request": self.abort_request,
            "control/sleep": self.sleep,
            "control/wake_up": self.wake_up,
        }

    async def liveness_probe(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        if not self.engine.alive and not self._swapping:
            return {"status": "error", "alive": False, "message": "engine is not serving"}
        return {
            "status": "ok",
            "alive": True,
            "instance_id": self.instance_id,
            "paused": self._mode.paused,
            "sleeping": self._mode.asleep,
            "engine_generation": self.engine.generation,
            **self.engine.stats(),
        }

    async def pause_generation(self, body: Any) -> dict[str, Any]:
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        mode = body.get("mode", "keep")
        clear_cache = bool(body.get("clear_cache", False))
        if mode not in PAUSE_MODES:
            return {
                "status": "error",
                "message": f"Invalid mode '{mode}'; expected keep|wait|abort",
            }
        async with self._lock:
            await self._enter(Event.HOLD if mode == "keep" else Event.PAUSE)
            if mode == "abort":
                await self._abort_in_flight()
            elif mode == "wait":
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: not any(not f.probe for f in self._flights)
                    )
            if clear_cache:
                try:
                    await self._reset_engine()
                except WorkerError as exc:
                    return {"status": "error", "message": str(exc)}
            log.info("[RL] Engine paused (mode=%s, clear_cache=%s)", mode, clear_cache)
            return {
                "status": "ok",
                "message": "Engine paused",
                "mode": mode,
                "clear_cache": clear_cache,
            }

    async def resume_generation(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            await self._enter(Event.RESUME)
            log.info("[RL] Engine resumed")
            return {"status": "ok", "message": "Engine resumed"}

    async def flush_cache(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            try:
                replaced = await self._reset_engine(only_if_used=True)
            except WorkerError as exc:
                return {"status": "error", "message": str(exc)}
            if replaced:
                log.info("[RL] Prefix cache flushed (engine %d)", self.engine.generation)
            else:
                log.info("[RL] Prefix cache empty: engine %d has served nothing since it "
                         "started", self.engine.generation)  # fmt: skip
            return {"status": "ok", "message": "Cache flushed"}

    async def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            if not self._mode.paused:
                return {"status": "error", "message": PAUSE_REQUIRED}
            if self._mode.asleep:
                return {"status": "error", "message": ASLEEP}
            path = body.get("model_path")
            if not path:
                return {"status": "error", "message": "Missing 'model_path' in body"}
            declared = "weight_version" in body
            version = body.get("weight_version", "unknown")
            try:
                weights = await asyncio.to_thread(load_checkpoint, Path(path), "numpy")
            except CheckpointError as exc:
                log.error("[RL] update_weights_from_disk failed: %s", exc)
                return {
                    "status": "error",
                    "message": f"weights not loaded, old weights kept: {exc}",
                }
            return await self._install(weights, version, declared)

    async def install_weights(self, weights: WeightSet, version: Any) -> dict[str, Any]:
        """Weights that arrived otherwise (a worker extension's colocated transfer), taken
        as `update_weights_from_disk` takes a checkpoint: only while paused and awake."""
        async with self._lock:
            if not self._mode.paused:
                return {"status": "error", "message": PAUSE_REQUIRED}
            if self._mode.asleep:
                return {"status": "error", "message": ASLEEP}
            return await self._install(weights, version, True)

    async def _install(self, weights: WeightSet, version: Any, declared: bool) -> dict[str, Any]:
        try:  # before the running engine is stopped: one that cannot start on them is kept
            await asyncio.to_thread(self.engine.check_weights, weights)
        except WorkerError as exc:
            log.error("[RL] weights refused: %s", exc)
            return {"status": "error", "message": f"weights not loaded, old weights kept: {exc}"}
        self.engine.use_weights(self.weights if self.serve_previous_weights else weights)
        self.weights = weights
        if declared:
            self.version, self.version_declared = version, True
        # Weights changed: cached prefixes were computed under the old ones.
        try:
            await self._reset_engine()
        except WorkerError as exc:
            return {"status": "error", "message": f"weights loaded but {exc}"}
        log.info(
            "[RL] Weights loaded from %s (version=%s, digest=%s)",
            weights.source, version, weights.digest,
        )
        return {
            "status": "ok",
            "version": version,
            "version_declared": declared,
            "digest": weights.digest,
            "model_path": str(weights.source),
            "num_tensors": weights.num_tensors,
        }

    async def get_weight_version(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        return {
            "status": "ok",
            "version": self.version if self.version_declared else None,
            "version_declared": self.version_declared,
            "digest": self.weights.digest,
            "model_path": str(self.weights.source),
        }

    async def set_weight_version(self, body: Any) -> dict[str, Any]:
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        if "weight_version" not in body:
            return {"status": "error", "message": "Missing 'weight_version' in body"}
        self.version, self.version_declared = body["weight_version"], True
        log.info("[RL] Weight version declared: %s", self.version)
        return {"status": "ok", "version": self.version}

    async def sleep(self, body: Any) -> dict[str, Any]:
        """dynamo.vllm's `control/sleep`: stop admitting, abort what is in flight, free the
        KV cache. Level 1 moves a GPU engine's weights to host memory; a CPU worker's
        weights already are there, so both levels keep them and differ in nothing here."""
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        level = body.get("level", 1)
        if level not in SLEEP_LEVELS:
            return {"status": "error", "message": f"Invalid level {level!r}; expected 1 or 2"}
        async with self._lock:
            if self._mode.asleep:
                return {"status": "ok", "message": "Engine already sleeping"}
            await self._enter(Event.SLEEP)
            await self._abort_in_flight()
            try:
                await self._reset_engine()
            except WorkerError as exc:
                return {"status": "error", "message": str(exc)}
            log.info("[Sleep] Engine slept (level=%s)", level)
            return {"status": "ok", "message": f"Engine slept (level={level})"}

    async def wake_up(self, body: Any) -> dict[str, Any]:
        """dynamo.vllm's `control/wake_up`: admit requests again (after any pause ends)."""
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            if not self._mode.asleep:
                return {"status": "ok", "message": "Engine already awake"}
            await self._enter(Event.WAKE)
            log.info("[Wake] Engine woke")
            return {"status": "ok", "message": "Engine woke"}

    async def abort_request(self, body: Any) -> dict[str, Any]:
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        request_id = body.get("request_id")
        if not request_id:
            return {"status": "error", "message": "Missing 'request_id' in body"}
        for flight in list(self._flights):
            if flight.request_id == str(request_id) and not flight.probe:
                flight.aborted = True
                if flight.pump is not None:
                    flight.pump.cancel()
        async with self._changed:
            self._changed.notify_all()
        return {"status": "ok", "request_id": request_id}
