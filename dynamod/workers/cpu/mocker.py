"""Dynamo's mocker engine on a private runtime, replaceable in place (a flush is a new engine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.kv_events import KvEventBridge
from dynamod.workers.weights import WeightSet

if TYPE_CHECKING:
    from dynamod.core.ports import PortAllocator

log = logging.getLogger("dynamod.workers.cpu")

# Where the engine runtime serves the mocker. Its discovery is a private directory, so
# the name never reaches etcd or the frontend.
ENGINE_ENDPOINT = "dynamod-engine.mocker.generate"
# Served by the long-lived client runtime for the worker's life, in the engine's component.
# A new mocker engine starts serving only once its component lists an instance, and it
# looks before its own endpoint is registered, then every 100 ms (Dynamo 1.6.1,
# lib/llm/src/mocker.rs): every engine built after a flush held its first request ~100 ms,
# most of a push's route step (bench.fleet, 1 x 1: 105 of 142 ms). With this instance there
# the first look finds one. Should it expire (a starved process), the engine waits as before.
PRESENCE_ENDPOINT = "dynamod-engine.mocker.present"
# A flushed engine's KV-event port is taken again by the next engine once its publisher
# has closed it; past this wait the next engine gets a fresh port instead.
PORT_FREE_S = 2.0


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


class MockerEngine:
    """Dynamo's mocker engine on a private runtime, replaceable in place.

    Each engine runs on its own runtime so that shutting that runtime down stops it;
    the client that reaches it lives on a separate, long-lived runtime (a runtime that
    acts as a client keeps a listener open after shutdown, so a client per engine
    would leak one per flush), which also serves PRESENCE_ENDPOINT so that a new engine
    serves at once. Both use file discovery in a private directory, which
    neither etcd nor the frontend ever see.

    `modeled_reset_s` (the worker's `--modeled-reset-s`, for benchmarks of the control
    plane): a reset keeps the engine and waits that long off the CPU instead, as an
    accelerator's in-place copy would; the router is still told the blocks are gone.
    """

    def __init__(
        self,
        model_path: str,
        model_name: str | None,
        engine_args: dict[str, Any],
        on_death: Callable[[BaseException | None], None],
        modeled_reset_s: float | None = None,
    ) -> None:
        self._model_path = model_path
        self._modeled_reset_s = modeled_reset_s
        self._model_name = model_name
        self._engine_args = engine_args
        self._on_death = on_death
        self._client: Any = None
        self._client_runtime: Any = None
        self._presence: asyncio.Future[Any] | None = None
        self._runtime: Any = None
        self._serving: asyncio.Future[Any] | None = None
        self._instance_id: int | None = None
        self._stopping = False
        self.generation = 0  # how many engines have been started; a flush adds one
        self.kv_events: KvEventBridge | None = None
        self.events_port = 0  # where the current engine publishes its KV events
        self._ports: PortAllocator | None = None  # one claim, kept for the worker's life

    def _new_runtime(self) -> Any:
        from dynamo.runtime import DistributedRuntime

        with _without_system_server():
            return DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")

    async def start(self, timeout: float = 60.0) -> None:
        from dynamo._core import EngineType, EntrypointArgs, make_engine, run_input
        from dynamo.mocker.config import apply_worker_engine_args_overrides, build_runtime_config

        begun = time.monotonic()
        if self._client is None:
            self._client_runtime = self._new_runtime()
            self._client = await self._client_runtime.endpoint(ENGINE_ENDPOINT).client()
            self._present()
        runtime = self._new_runtime()
        events_port = await self._events_port()
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
        log.info("mocker engine %d serving as %x (built in %.0f ms)", self.generation,
                 self._instance_id, 1000 * (time.monotonic() - begun))  # fmt: skip

    def _present(self) -> None:
        """Serve PRESENCE_ENDPOINT on the client runtime. Not waited for: a client that
        watched for it would hold one more inotify instance per worker for its life (a
        fleet of 256 shards on one machine ran out: "Too many open files"); the first
        engine, built while it registers, may wait its 100 ms once."""

        async def refuse(_request: Any) -> AsyncIterator[Any]:
            raise WorkerError(f"{PRESENCE_ENDPOINT} serves nothing")
            yield  # an async generator, as Dynamo's handlers are

        endpoint = self._client_runtime.endpoint(PRESENCE_ENDPOINT)
        with _without_system_server():
            self._presence = asyncio.ensure_future(
                endpoint.serve_endpoint(refuse, graceful_shutdown=False)
            )
        self._presence.add_done_callback(self._presence_ended)

    def _presence_ended(self, serving: asyncio.Future[Any]) -> None:
        if self._client_runtime is None or serving.cancelled():
            return  # closed
        error = serving.exception()
        log.warning("%s stopped (%s): each new mocker engine waits 100 ms before it serves",
                    PRESENCE_ENDPOINT, error or "no error")  # fmt: skip

    async def _new_instance(self) -> int:
        previous = self._instance_id
        while True:
            fresh = [i for i in self._client.instance_ids() if i != previous]
            if fresh:
                return int(fresh[0])
            await asyncio.sleep(0.01)

    async def _events_port(self) -> int:
        """The port the next engine publishes its KV events on: the last engine's, once
        its publisher let go of it, so one port for the worker's life. A new port per
        flush was a new claim in the machine's port registry, held for the worker's life,
        and every allocation reads every live claim: at 8 nodes x 32 shards on one
        machine each flush read ~1,000 claim files (bench.fleet: about half of a shard's
        83 ms of Python in a push), and the claims grew with every push."""
        from dynamod.core.ports import PortAllocator, in_use

        port = self.events_port
        if port:
            deadline = time.monotonic() + PORT_FREE_S
            while in_use(port) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # released within ms of the stop; a bind test is µs
            if not in_use(port):
                return port
            log.warning("mocker engine's KV-event port %d still held after %.1f s: a new one",
                        port, PORT_FREE_S)  # fmt: skip
        if self._ports is None:
            self._ports = PortAllocator()
        return self._ports()

    def _served(self, serving: asyncio.Future[Any]) -> None:
        if self._stopping or serving is not self._serving:
            return
        error = None if serving.cancelled() else serving.exception()
        self._on_death(error)

    @property
    def alive(self) -> bool:
        return self._serving is not None and not self._serving.done()

    def bind_kv_events(self, bridge: KvEventBridge) -> None:
        self.kv_events = bridge
        bridge.attach(self.events_port)

    def halt(self) -> None:
        """Nothing to do ahead of `close`: the mocker stops with its runtime."""

    def check_weights(self, weights: WeightSet) -> None:
        """The mocker's tokens do not depend on the weights: any checkpoint fits."""

    def use_weights(self, weights: WeightSet) -> None:
        """The mocker's tokens do not depend on the weights: nothing to load."""

    def stats(self) -> dict[str, Any]:
        if self._modeled_reset_s is None:
            return {"engine": "mocker"}
        return {"engine": "mocker", "modeled_reset_s": self._modeled_reset_s}

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
        runtime, self._client_runtime = self._client_runtime, None  # closed: see _presence_ended
        if runtime is not None:
            runtime.shutdown()
            if self._presence is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(self._presence, 5)
            self._client = self._presence = None

    async def restart(self) -> None:
        if self._modeled_reset_s is not None:
            if not self.alive:
                raise WorkerError("mocker engine is not running")
            if self._registered():
                await self._modeled_reset(self._modeled_reset_s)
                return
            log.warning("mocker engine %d: its instance left the engine's discovery (expired "
                        "while the process was starved?): a new engine, not a modeled reset",
                        self.generation)  # fmt: skip
        await self.stop()
        try:
            await self.start()
        except Exception as exc:
            self._on_death(exc)  # no engine any more: the worker must go down
            raise

    def reachable(self) -> bool:
        return self.alive and self._registered()

    def _registered(self) -> bool:
        """Whether the engine's instance is still in its private discovery. The file store
        drops an instance whose keep-alive came late (a worker starved for seconds on a
        crowded machine: bench.fleet's 32 shards a node on two cores), and nothing puts it
        back: only a new engine is reachable again."""
        return self._client is not None and self._instance_id in self._client.instance_ids()

    async def _modeled_reset(self, seconds: float) -> None:
        """The engine kept; the wait an accelerator's reset would take, off the CPU; the
        router told that the worker's blocks are gone, as after a new engine."""
        await asyncio.sleep(seconds)
        if self.kv_events is not None:
            await self.kv_events.clear()
        self.generation += 1
        log.info("mocker engine %d: a modeled reset (%.3f s off the CPU, engine kept)",
                 self.generation, seconds)  # fmt: skip

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        if self._client is None or self._instance_id is None or not self.alive:
            raise WorkerError("mocker engine is not running")
        stream = await self._client.direct(request, self._instance_id)
        async for item in stream:
            yield item.data()
