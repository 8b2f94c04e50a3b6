"""The CPU worker's process: the public runtime, registration, routes, shutdown."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dynamod.workers.cpu.admission import CpuWorker
from dynamod.workers.cpu.args import (
    check_system_port,
    engine_args_for,
    parse_args,
    parse_version,
    set_blas_threads,
)
from dynamod.workers.cpu.discovery import directory as discovery_directory
from dynamod.workers.cpu.engine import Engine
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.kv_events import KvEventBridge
from dynamod.workers.cpu.mocker import MockerEngine
from dynamod.workers.cpu.routes import catching, prefix_cache_metrics, upstream_taint_route
from dynamod.workers.model import ModelDirError, check_model_dir
from dynamod.workers.weights import CheckpointError, load_checkpoint

log = logging.getLogger("dynamod.workers.cpu")

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


def health_check_payload(model_dir: Path) -> dict[str, Any]:
    from dynamo.common.backend.health_check import build_health_check_payload

    config = json.loads((model_dir / "config.json").read_text())
    payload: dict[str, Any] = build_health_check_payload(int(config.get("bos_token_id") or 1))
    return payload


async def serve(ours: argparse.Namespace, mocker: argparse.Namespace) -> int:
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    model_dir = Path(mocker.model_path)
    weights = await asyncio.to_thread(load_checkpoint, model_dir, "numpy")
    log.info("initial weights %s (digest %s)", weights.source, weights.digest)

    fatal: list[str] = []
    runtime: Any = None

    def engine_died(error: BaseException | None) -> None:
        fatal.append(f"{ours.engine} engine stopped serving: {error}")
        log.error("%s; shutting down", fatal[-1])
        if runtime is not None:
            runtime.shutdown()

    engine, block_size, runtime_config = await _start_engine(ours, mocker, weights, engine_died)
    runtime = DistributedRuntime(
        loop,
        mocker.discovery_backend,
        mocker.request_plane,
        event_plane=mocker.event_plane,
        response_plane=mocker.response_plane,
    )
    endpoint = runtime.endpoint(mocker.endpoint.removeprefix("dyn://"))
    worker = _worker(ours, engine, weights)
    worker.instance_id = endpoint.connection_id()
    extension = None
    if ours.worker_extension_cls:
        from dynamod.workers.cpu.extension import host_extension

        extension = host_extension(ours.worker_extension_cls, worker, loop)
    _add_routes(runtime, endpoint, worker, engine, mocker.model_name)
    engine.bind_kv_events(KvEventBridge(endpoint, block_size))
    runtime_config.enable_local_indexer = True  # the bridge's publisher keeps one
    await _register(endpoint, mocker, block_size, runtime_config)
    closing = _stop_on_signals(loop, worker, engine, runtime)  # keeps the close task referenced

    log.info("serving %s as instance %s (etcd lease %x), version %s%s", mocker.endpoint,
             worker.instance_id, worker.instance_id or 0,
             worker.version if worker.version_declared else "undeclared",
             ", paused until resume_generation admits it" if ours.start_paused else "")  # fmt: skip
    watching = asyncio.ensure_future(worker.keep_reachable())
    try:
        await endpoint.serve_endpoint(
            worker.generate, health_check_payload=health_check_payload(model_dir)
        )
    finally:
        watching.cancel()
        if extension is not None:
            await asyncio.to_thread(extension.dynamod_close)
        await engine.close()
    del closing  # held until the endpoint stopped serving: the close task ran by then
    if fatal:
        print(f"dynamod.workers.cpu: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


async def _start_engine(
    ours: argparse.Namespace, mocker: argparse.Namespace, weights: Any, on_death: Any
) -> tuple[Engine, int, Any]:
    """The engine `--engine` names, started; its KV block size and the runtime config
    Dynamo is told of."""
    from dynamo.mocker.config import build_runtime_config

    engine_args = engine_args_for(mocker)
    block_size, runtime_config = build_runtime_config(engine_args)
    engine: Engine
    if ours.engine == "mocker":
        model = str(Path(mocker.model_path))
        engine = MockerEngine(
            model, mocker.model_name, engine_args, on_death, modeled_reset_s=ours.modeled_reset_s
        )
    else:
        from dynamod.workers.cpu.numpy_engine import NumpyEngine  # numpy after --threads

        model_dir = Path(mocker.model_path)
        engine = NumpyEngine(model_dir, weights, block_size, ours.cache_blocks, on_death)
        runtime_config.total_kv_blocks = ours.cache_blocks
    await engine.start()
    return engine, block_size, runtime_config


def _worker(ours: argparse.Namespace, engine: Engine, weights: Any) -> CpuWorker:
    version = parse_version(ours.initial_version) if ours.initial_version is not None else None
    return CpuWorker(
        engine,
        weights,
        version=version,
        version_declared=ours.initial_version is not None,
        drain_timeout=ours.drain_timeout,
        serve_previous_weights=ours.test_serve_previous_weights,
        start_paused=ours.start_paused,
    )


def _add_routes(runtime: Any, endpoint: Any, worker: CpuWorker, engine: Engine, model: str) -> None:
    """The system server's engine routes (dynamod's and upstream's taint route) and the
    prefix-cache metrics."""
    for name, handler in worker.routes().items():
        runtime.register_engine_route(name, catching(name, handler))
    # As upstream, a bad taint list raises: the system server answers HTTP 500.
    runtime.register_engine_route(
        "update/model_taints", worker.serialised(upstream_taint_route(runtime, endpoint))
    )
    endpoint.metrics.register_prometheus_expfmt_callback(
        lambda: prefix_cache_metrics(engine.stats(), model)
    )


async def _register(
    endpoint: Any, mocker: argparse.Namespace, block_size: int, runtime_config: Any
) -> None:
    from dynamo.common.configuration.groups.router_args import build_router_config
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        str(Path(mocker.model_path)),
        mocker.model_name,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=block_size,
        runtime_config=runtime_config,
        router_config=build_router_config(mocker.router_advertisement),
    )


def _stop_on_signals(
    loop: asyncio.AbstractEventLoop, worker: CpuWorker, engine: Engine, runtime: Any
) -> list[asyncio.Future[None]]:
    """SIGTERM/SIGINT: unregister, stop the engine and the runtime. The returned list
    holds the close task, which must stay referenced until it is done."""
    closing: list[asyncio.Future[None]] = []

    def shutdown() -> None:
        log.info("shutdown signal: unregistering and stopping")
        closing.append(asyncio.ensure_future(worker.close()))
        engine.halt()
        runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)
    return closing


def main(argv: list[str] | None = None) -> int:
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        ours, mocker = parse_args(sys.argv[1:] if argv is None else argv)
        set_blas_threads(ours.threads)
        check_model_dir(Path(mocker.model_path))
        check_system_port()
        if ours.worker_extension_cls:
            from dynamod.workers.cpu.extension import extension_class

            extension_class(ours.worker_extension_cls)  # refused before anything starts
    except (WorkerError, ModelDirError) as exc:
        print(f"dynamod.workers.cpu: error: {exc}", file=sys.stderr)
        return 2

    import uvloop
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    # The engine's discovery: a directory of this process only.
    with discovery_directory() as discovery:
        os.environ["DYN_FILE_KV"] = discovery
        try:
            return uvloop.run(serve(ours, mocker))
        except (CheckpointError, WorkerError) as exc:
            print(f"dynamod.workers.cpu: error: {exc}", file=sys.stderr)
            return 2
        finally:
            # torch (imported by a --worker-extension-cls such as verl's) leaves a
            # large object graph; collecting it at exit takes seconds on a busy
            # machine and would stall a shutdown. Nothing in it needs finalising
            # (the runtime and the engine are already closed).
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
