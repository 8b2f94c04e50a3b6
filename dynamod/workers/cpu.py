"""CPU rollout worker: Dynamo's mocker engine behind dynamo.vllm's RL admin routes.

    python -m dynamod.workers.cpu --model-path DIR [--model-name NAME] [dynamo.mocker flags]
                                  [--initial-version V] [--drain-timeout S]

Two Dynamo runtimes share this process and its event loop:

* the *engine* runtime (file discovery in a private directory, invisible outside) serves
  Dynamo's mocker engine exactly as `python -m dynamo.mocker` builds it
  (`make_engine` + `run_input`);
* the *public* runtime (etcd discovery) registers the model and serves the worker's
  `generate` endpoint, which forwards each request to the engine. It also serves the
  RL admin routes of `dynamo.vllm` 1.6.1 on the system port (`POST /engine/<name>`),
  with the same request and response shapes.

Standing between the frontend and the engine is what makes those routes real:
`pause_generation` stops admission (new requests wait until `resume_generation`),
`flush_cache` replaces the engine with a fresh one, which has no cached prefix
blocks (the mocker offers no other reset; the public instance id stays the same),
and every response carries the weight version it was admitted under, the weights'
digest and the serving instance in `engine_data` (returned by the frontend as
`nvext.engine_data` when a request asks for `"nvext": {"extra_fields": ["engine_data"]}`).
The engine's KV events are relayed to the router as the public worker's, and a flush
tells the router that all of the worker's blocks are gone.

The worker holds real tensors: the model directory's `model.safetensors` at start,
replaced by `update_weights_from_disk`. The mocker's output does not depend on them;
what matters to the stack is which weights, which version, which digest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError
from dynamod.workers.model import ModelDirError, check_model_dir
from dynamod.workers.weights import CheckpointError, WeightSet, load_checkpoint

log = logging.getLogger("dynamod.workers.cpu")

# Where the engine runtime serves the mocker. Its discovery is a private directory, so
# the name never reaches etcd or the frontend.
ENGINE_ENDPOINT = "dynamod-engine.mocker.generate"

# Set unless the environment says otherwise: loopback for every listener Dynamo opens,
# and no compute thread pool (the mocker sets the latter too).
ENV_DEFAULTS = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_HTTP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_COMPUTE_THREADS": "0",
}

PAUSE_MODES = ("keep", "wait", "abort")
PAUSE_REQUIRED = (
    "Worker must be paused via pause_generation() before updating weights. "
    "Call pause_generation() first, then update, then resume_generation()."
)
NOT_AN_OBJECT = {"status": "error", "message": "request body must be a JSON object"}

RouteHandler = Callable[[Any], Awaitable[dict[str, Any]]]


class WorkerError(DynamodError):
    """The worker cannot start or keep serving; the message is for the operator."""


def parse_version(text: str) -> int | str:
    """`--initial-version` as the JSON value a trainer would send: an integer step or text."""
    try:
        return int(text)
    except ValueError:
        return text


@contextlib.contextmanager
def _without_system_server() -> Iterator[None]:
    """Hide DYN_SYSTEM_PORT while an engine-side runtime is built.

    Each DistributedRuntime starts a system server when the variable is set; only the
    public runtime may own the port (it carries /health and the admin routes). The
    engine serves no model metadata either: nothing outside the process reads it.
    """
    hidden = {"DYN_SYSTEM_PORT": None, "DYN_SELF_HOST_METADATA": "0"}
    saved = {name: os.environ.get(name) for name in hidden}
    for name, value in hidden.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class KvEventBridge:
    """Relays the engine's KV events to the router under the public worker's identity.

    Each engine publishes vLLM-format KV events on its own ZMQ port. The bridge
    forwards them to one stable ZMQ socket that Dynamo's `KvEventPublisher` relays to
    the router as events of the public endpoint. When an engine is replaced, the
    bridge tells the router all of this worker's blocks are gone (`AllBlocksCleared`),
    so the router's view is flushed together with the engine.
    """

    def __init__(self, endpoint: Any, block_size: int) -> None:
        import zmq
        import zmq.asyncio
        from dynamo.llm import KvEventPublisher

        self._zmq = zmq
        self._context = zmq.asyncio.Context()
        self._out = self._context.socket(zmq.PUB)
        self._out.setsockopt(zmq.LINGER, 0)
        port = self._out.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32767)
        self._sequence = 0
        self._forwarding: asyncio.Task[None] | None = None
        self._relay = KvEventPublisher(
            endpoint,
            kv_block_size=block_size,
            zmq_endpoint=f"tcp://127.0.0.1:{port}",
            enable_local_indexer=True,
        )

    def attach(self, engine_port: int) -> None:
        """Forward the events an engine publishes on `engine_port` from now on."""
        source = self._context.socket(self._zmq.SUB)
        source.setsockopt(self._zmq.LINGER, 0)
        source.setsockopt(self._zmq.SUBSCRIBE, b"")
        source.connect(f"tcp://127.0.0.1:{engine_port}")
        self._forwarding = asyncio.create_task(self._forward(source))

    async def _forward(self, source: Any) -> None:
        try:
            while True:
                topic, _, payload = await source.recv_multipart()
                await self._send(topic, payload)
        finally:
            source.close()

    async def _send(self, topic: bytes, payload: bytes) -> None:
        # Sequence numbers must keep rising across engines; each engine counts from 0.
        sequence = self._sequence.to_bytes(8, "big")
        self._sequence += 1
        await self._out.send_multipart([topic, sequence, payload])

    async def detach_and_clear(self) -> None:
        """Stop forwarding (the engine is gone) and clear the router's view of this worker."""
        import msgspec

        if self._forwarding is not None:
            self._forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._forwarding
            self._forwarding = None
        batch = [time.time(), [{"type": "AllBlocksCleared"}], 0]
        await self._send(b"", msgspec.msgpack.encode(batch))

    async def close(self) -> None:
        if self._forwarding is not None:
            self._forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._forwarding
        self._relay.shutdown()
        self._out.close()
        self._context.term()


class MockerEngine:
    """Dynamo's mocker engine on a private runtime, replaceable in place.

    Each engine runs on its own runtime so that shutting that runtime down stops it;
    the client that reaches it lives on a separate, long-lived runtime (a runtime that
    acts as a client keeps a listener open after shutdown, so a client per engine
    would leak one per flush). Both use file discovery in a private directory, which
    neither etcd nor the frontend ever see.
    """

    def __init__(
        self,
        model_path: str,
        model_name: str | None,
        engine_args: dict[str, Any],
        on_death: Callable[[BaseException | None], None],
    ) -> None:
        self._model_path = model_path
        self._model_name = model_name
        self._engine_args = engine_args
        self._on_death = on_death
        self._client: Any = None
        self._client_runtime: Any = None
        self._runtime: Any = None
        self._serving: asyncio.Future[Any] | None = None
        self._instance_id: int | None = None
        self._stopping = False
        self.generation = 0  # how many engines have been started; a flush adds one
        self.kv_events: KvEventBridge | None = None
        self.events_port = 0  # where the current engine publishes its KV events

    def _new_runtime(self) -> Any:
        from dynamo.runtime import DistributedRuntime

        with _without_system_server():
            return DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")

    async def start(self, timeout: float = 60.0) -> None:
        from dynamo._core import EngineType, EntrypointArgs, make_engine, run_input
        from dynamo.mocker.config import apply_worker_engine_args_overrides, build_runtime_config

        if self._client is None:
            self._client_runtime = self._new_runtime()
            self._client = await self._client_runtime.endpoint(ENGINE_ENDPOINT).client()
        runtime = self._new_runtime()
        events_port = _free_loopback_port()
        engine_args = apply_worker_engine_args_overrides(
            self._engine_args, zmq_kv_events_port=events_port
        )
        block_size, runtime_config = build_runtime_config(engine_args)
        entry = EntrypointArgs(
            engine_type=EngineType.Mocker,
            model_path=self._model_path,
            model_name=self._model_name,
            endpoint_id=f"dyn://{ENGINE_ENDPOINT}",
            mocker_engine_args=engine_args,
            runtime_config=runtime_config,
            kv_cache_block_size=block_size,
        )
        with _without_system_server():
            engine_config = await make_engine(runtime, entry)
            serving = asyncio.ensure_future(
                run_input(runtime, f"dyn://{ENGINE_ENDPOINT}", engine_config)
            )
        self._instance_id = await asyncio.wait_for(self._new_instance(), timeout)
        self._runtime, self._serving = runtime, serving
        self._stopping = False
        self.events_port = events_port
        if self.kv_events is not None:
            self.kv_events.attach(events_port)
        serving.add_done_callback(self._served)
        self.generation += 1
        log.info("mocker engine %d serving as %x", self.generation, self._instance_id)

    async def _new_instance(self) -> int:
        previous = self._instance_id
        while True:
            fresh = [i for i in self._client.instance_ids() if i != previous]
            if fresh:
                return int(fresh[0])
            await asyncio.sleep(0.01)

    def _served(self, serving: asyncio.Future[Any]) -> None:
        if self._stopping or serving is not self._serving:
            return
        error = None if serving.cancelled() else serving.exception()
        self._on_death(error)

    @property
    def alive(self) -> bool:
        return self._serving is not None and not self._serving.done()

    async def stop(self) -> None:
        serving, runtime = self._serving, self._runtime
        if serving is None:
            return
        self._stopping = True
        runtime.shutdown()
        # run_input reports its own shutdown as an error; that is the expected end.
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(serving, 10)
        self._serving = self._runtime = None
        if self.kv_events is not None:
            await self.kv_events.detach_and_clear()

    async def close(self) -> None:
        await self.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self._client_runtime is not None:
            self._client_runtime.shutdown()
            self._client_runtime = self._client = None

    async def restart(self) -> None:
        await self.stop()
        try:
            await self.start()
        except Exception as exc:
            self._on_death(exc)  # no engine any more: the worker must go down
            raise

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        if self._client is None or self._instance_id is None or not self.alive:
            raise WorkerError("mocker engine is not running")
        stream = await self._client.direct(request, self._instance_id)
        async for item in stream:
            yield item.data()


def _free_loopback_port() -> int:
    from dynamod.core.ports import PortAllocator

    return PortAllocator()()


def _engine_shutdown(message: str) -> Exception:
    """Dynamo's typed error for a dead engine: the frontend migrates such requests."""
    from dynamo.llm.exceptions import EngineShutdown

    error: Exception = EngineShutdown(message)
    return error


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
    in_engine: bool = True  # counted in CpuWorker._pumping until it leaves the engine


class CpuWorker:
    """Admission, weights and the RL admin routes of one CPU rollout worker.

    One lock serialises pause, resume, flush and weight updates, as upstream's
    `_pause_lock` does, so a resume can never interleave with an update.
    """

    def __init__(
        self,
        engine: MockerEngine,
        weights: WeightSet,
        version: Any = None,
        version_declared: bool = False,
        drain_timeout: float = 60.0,
    ) -> None:
        self.engine = engine
        self.weights = weights
        self.version = version
        self.version_declared = version_declared
        self.drain_timeout = drain_timeout
        self.instance_id: int | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._paused = False  # new requests wait at admission
        self._holding = False  # in-flight output is held back (pause mode "keep")
        self._swapping = False  # the engine is being replaced; nothing enters it
        self._closing = False  # shutting down: nothing waits any more
        self._flights: set[_Flight] = set()
        self._pumping = 0  # requests still inside the engine

    # ----------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[Any]:
        from dynamo.common.backend.health_check import HEALTH_CHECK_KEY, is_probe

        probe = is_probe(request)
        if probe:
            request = {k: v for k, v in request.items() if k != HEALTH_CHECK_KEY}
        flight = await self._admit(probe)
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
                    raise _engine_shutdown(f"mocker engine failed: {chunk}") from chunk
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

    async def _admit(self, probe: bool) -> _Flight:
        async with self._changed:
            # Health probes pass a pause: a paused worker is held, not unhealthy.
            await self._changed.wait_for(
                lambda: self._closing or (not self._swapping and (probe or not self._paused))
            )
            if self._closing:
                # Typed, so the frontend migrates the request to another worker.
                raise _engine_shutdown("worker is shutting down")
            flight = _Flight(self.version, self.weights.digest, probe)
            self._flights.add(flight)
            self._pumping += 1
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
            await self._changed.wait_for(
                lambda: not self._holding or flight.aborted or self._closing
            )
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
        async with self._changed:
            self._closing = True
            self._changed.notify_all()

    # ------------------------------------------------------------- engine control

    async def _reset_engine(self) -> None:
        """Replace the engine once no request is inside it; admission waits meanwhile."""
        async with self._changed:
            self._swapping = True
        try:
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._pumping == 0), self.drain_timeout
                )
            await self.engine.restart()
        except TimeoutError as exc:
            raise WorkerError(
                f"cache not flushed: {self._pumping} request(s) still in the engine "
                f"after {self.drain_timeout}s"
            ) from exc
        finally:
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()

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
        }

    async def liveness_probe(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        if not self.engine.alive and not self._swapping:
            return {"status": "error", "alive": False, "message": "mocker engine is not serving"}
        return {
            "status": "ok",
            "alive": True,
            "instance_id": self.instance_id,
            "paused": self._paused,
            "engine_generation": self.engine.generation,
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
            async with self._changed:
                self._paused = True
                self._holding = mode == "keep"
                self._changed.notify_all()
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
            async with self._changed:
                self._paused = self._holding = False
                self._changed.notify_all()
            log.info("[RL] Engine resumed")
            return {"status": "ok", "message": "Engine resumed"}

    async def flush_cache(self, body: Any) -> dict[str, Any]:
        if body is not None and not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            try:
                await self._reset_engine()
            except WorkerError as exc:
                return {"status": "error", "message": str(exc)}
            log.info("[RL] Prefix cache flushed (engine %d)", self.engine.generation)
            return {"status": "ok", "message": "Cache flushed"}

    async def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        body = {} if body is None else body
        if not isinstance(body, dict):
            return NOT_AN_OBJECT
        async with self._lock:
            if not self._paused:
                return {"status": "error", "message": PAUSE_REQUIRED}
            path = body.get("model_path")
            if not path:
                return {"status": "error", "message": "Missing 'model_path' in body"}
            declared = "weight_version" in body
            version = body.get("weight_version", "unknown")
            try:
                weights = await asyncio.to_thread(load_checkpoint, Path(path))
            except CheckpointError as exc:
                log.error("[RL] update_weights_from_disk failed: %s", exc)
                return {
                    "status": "error",
                    "message": f"weights not loaded, old weights kept: {exc}",
                }
            self.weights = weights
            if declared:
                self.version, self.version_declared = version, True
            # Weights changed: cached prefixes were computed under the old ones.
            try:
                await self._reset_engine()
            except WorkerError as exc:
                return {"status": "error", "message": f"weights loaded but {exc}"}
            log.info(
                "[RL] Weights loaded from %s (version=%s, digest=%s)", path, version, weights.digest
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


def _upstream_taint_route(runtime: Any, endpoint: Any) -> RouteHandler:
    """dynamo.vllm's own `update/model_taints` handler, captured instead of registered."""
    from dynamo.common.model_taints import MODEL_TAINT_ROUTE, register_model_taint_route

    captured: dict[str, RouteHandler] = {}

    class _Capture:
        def register_engine_route(self, name: str, handler: RouteHandler) -> None:
            captured[name] = handler

    register_model_taint_route(_Capture(), endpoint)  # type: ignore[arg-type]
    return captured[MODEL_TAINT_ROUTE]


def _catching(name: str, handler: RouteHandler) -> RouteHandler:
    """An unexpected failure answers `{"status": "error"}`, as upstream's RL handlers do."""

    async def answer(body: Any) -> dict[str, Any]:
        try:
            return await handler(body)
        except Exception as exc:
            log.exception("[RL] %s failed", name)
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}

    return answer


# ---------------------------------------------------------------------- startup


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(own options, dynamo.mocker's options); every dynamo.mocker flag is accepted."""
    own = argparse.ArgumentParser(
        prog="python -m dynamod.workers.cpu",
        description=(
            "CPU rollout worker: Dynamo's mocker engine with dynamo.vllm's RL admin routes. "
            "Also accepts the flags of `python -m dynamo.mocker` (--model-path, --model-name, "
            "--endpoint, --discovery-backend, --block-size, --speedup-ratio, ...)."
        ),
    )
    own.add_argument(
        "--initial-version",
        help="weight version declared at start (an integer step or text); default: undeclared",
    )
    own.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a cache flush waits for requests to leave the engine (default 60)",
    )
    ours, rest = own.parse_known_args(argv)

    from dynamo.mocker.args import parse_args as parse_mocker_args

    mocker = parse_mocker_args(rest)
    unsupported = [
        (mocker.num_workers != 1, "--num-workers (run one worker process per replica)"),
        (mocker.disaggregation_mode != "agg", "--disaggregation-mode other than agg"),
        (bool(mocker.bootstrap_ports_list), "--bootstrap-ports"),
        (bool(mocker.zmq_kv_events_ports_list), "--zmq-kv-events-ports"),
    ]
    for bad, what in unsupported:
        if bad:
            raise WorkerError(f"{what} is not supported by the CPU worker")
    if not mocker.model_path:
        raise WorkerError("--model-path is required (a local model directory)")
    return ours, mocker


def check_system_port() -> None:
    raw = os.environ.get("DYN_SYSTEM_PORT", "")
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port <= 32767:
        raise WorkerError(
            f"DYN_SYSTEM_PORT={raw!r}: set it to a port in 1..32767 "
            "(Dynamo reads it as a 16-bit signed integer); /health and /engine/* live there"
        )


def engine_args_for(mocker: argparse.Namespace) -> dict[str, Any]:
    from dynamo.mocker.config import apply_worker_engine_args_overrides, load_mocker_engine_args
    from dynamo.mocker.utils.kv_cache import compute_kv_bytes_per_token

    kv_bytes = mocker.kv_bytes_per_token
    if kv_bytes is None:
        kv_bytes = compute_kv_bytes_per_token(mocker.model_path, mocker.kv_cache_dtype)
    engine_args: dict[str, Any] = apply_worker_engine_args_overrides(
        load_mocker_engine_args(mocker), kv_bytes_per_token=kv_bytes
    )
    return engine_args


def health_check_payload(model_dir: Path) -> dict[str, Any]:
    from dynamo.common.backend.health_check import build_health_check_payload

    config = json.loads((model_dir / "config.json").read_text())
    payload: dict[str, Any] = build_health_check_payload(int(config.get("bos_token_id") or 1))
    return payload


async def serve(ours: argparse.Namespace, mocker: argparse.Namespace) -> int:
    from dynamo.common.configuration.groups.router_args import build_router_config
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.mocker.config import build_runtime_config
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    model_dir = Path(mocker.model_path)
    weights = await asyncio.to_thread(load_checkpoint, model_dir)
    log.info("initial weights %s (digest %s)", weights.source, weights.digest)
    engine_args = engine_args_for(mocker)

    fatal: list[str] = []
    runtime: Any = None

    def engine_died(error: BaseException | None) -> None:
        fatal.append(f"mocker engine stopped serving: {error}")
        log.error("%s; shutting down", fatal[-1])
        if runtime is not None:
            runtime.shutdown()

    engine = MockerEngine(str(model_dir), mocker.model_name, engine_args, engine_died)
    await engine.start()

    runtime = DistributedRuntime(
        loop,
        mocker.discovery_backend,
        mocker.request_plane,
        event_plane=mocker.event_plane,
        response_plane=mocker.response_plane,
    )
    endpoint = runtime.endpoint(mocker.endpoint.removeprefix("dyn://"))
    version = parse_version(ours.initial_version) if ours.initial_version is not None else None
    worker = CpuWorker(
        engine,
        weights,
        version=version,
        version_declared=ours.initial_version is not None,
        drain_timeout=ours.drain_timeout,
    )
    worker.instance_id = endpoint.connection_id()
    for name, handler in worker.routes().items():
        runtime.register_engine_route(name, _catching(name, handler))
    # As upstream, a bad taint list raises: the system server answers HTTP 500.
    runtime.register_engine_route(
        "update/model_taints", worker.serialised(_upstream_taint_route(runtime, endpoint))
    )

    block_size, runtime_config = build_runtime_config(engine_args)
    engine.kv_events = KvEventBridge(endpoint, block_size)
    engine.kv_events.attach(engine.events_port)
    runtime_config.enable_local_indexer = True  # the bridge's publisher keeps one
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        str(model_dir),
        mocker.model_name,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=block_size,
        runtime_config=runtime_config,
        router_config=build_router_config(mocker.router_advertisement),
    )

    closing: list[asyncio.Future[None]] = []  # keeps the close task referenced

    def shutdown() -> None:
        log.info("shutdown signal: unregistering and stopping")
        closing.append(asyncio.ensure_future(worker.close()))
        runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)

    log.info(
        "serving %s as instance %s (etcd lease %x), version %s",
        mocker.endpoint,
        worker.instance_id,
        worker.instance_id or 0,
        worker.version if worker.version_declared else "undeclared",
    )
    try:
        await endpoint.serve_endpoint(
            worker.generate, health_check_payload=health_check_payload(model_dir)
        )
    finally:
        await engine.close()
    if fatal:
        print(f"dynamod.workers.cpu: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        ours, mocker = parse_args(sys.argv[1:] if argv is None else argv)
        check_model_dir(Path(mocker.model_path))
        check_system_port()
    except (WorkerError, ModelDirError) as exc:
        print(f"dynamod.workers.cpu: error: {exc}", file=sys.stderr)
        return 2

    import uvloop
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    # The engine's discovery: a directory of this process only.
    with tempfile.TemporaryDirectory(prefix="dynamod-cpu-worker-") as discovery:
        os.environ["DYN_FILE_KV"] = discovery
        try:
            return uvloop.run(serve(ours, mocker))
        except CheckpointError as exc:
            print(f"dynamod.workers.cpu: error: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
