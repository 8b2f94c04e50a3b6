"""Hosting a vLLM worker extension class (`--worker-extension-cls`) in the CPU worker.

vLLM mixes the extension into its GPU worker, whose `model_runner.model.load_weights`
takes the tensors. Here the class is mixed with `CpuSurface`, which gives it the same
surface: `load_weights` keeps a numpy copy of each tensor (same digest), and at the end of
an update the copies become the worker's weights through `CpuWorker.install_weights` on the worker's
event loop (paused and awake only, a fresh engine, the version declared), exactly as a
checkpoint loaded by `update_weights_from_disk` does. The class is named by its dotted
path, so the worker imports nothing of the integration that supplies it.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError
from dynamod.workers.cpu.admission import CpuWorker
from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.weights import WeightSet, state_dict_digest

INSTALL_TIMEOUT_S = 300.0


class _CollectingModel:
    def __init__(self) -> None:
        self.received: dict[str, Any] = {}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy each torch tensor into a numpy array (the engine's); numpy has no
        bfloat16, so such a tensor is refused by name rather than converted."""
        names = set()
        for name, tensor in weights:
            try:
                self.received[name] = tensor.detach().to("cpu", copy=True).numpy()
            except TypeError as exc:
                raise WorkerError(
                    f"weight {name!r} has dtype {tensor.dtype}, which the numpy engine "
                    f"cannot hold ({exc})"
                ) from exc
            names.add(name)
        return names


class _ModelRunner:
    def __init__(self) -> None:
        self.model = _CollectingModel()


class CpuSurface:
    """What the extension expects of a vLLM worker, backed by a CpuWorker."""

    worker: CpuWorker
    loop: asyncio.AbstractEventLoop

    def __init__(self, worker: CpuWorker, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        self.device = None
        self.model_runner = _ModelRunner()

    def dynamod_begin_update(self, step: int) -> None:
        self.model_runner.model.received = {}
        super().dynamod_begin_update(step)  # type: ignore[misc]

    def dynamod_finish_update(self, step: int, digest: str) -> dict[str, Any]:
        tensors = self.model_runner.model.received
        self.model_runner.model.received = {}
        if not tensors:
            raise WorkerError(f"update to step {step} carried no tensors")
        weights = WeightSet(tensors, state_dict_digest(tensors), Path(f"ipc:step-{step}"))
        future = asyncio.run_coroutine_threadsafe(
            self.worker.install_weights(weights, step), self.loop
        )
        answer = future.result(INSTALL_TIMEOUT_S)
        if answer.get("status") != "ok":
            raise WorkerError(f"update to step {step} not installed: {answer.get('message')}")
        return {"digest": weights.digest, "version": step}

    def dynamod_abort_update(self, reason: str) -> None:
        self.model_runner.model.received = {}
        super().dynamod_abort_update(reason)  # type: ignore[misc]


def extension_class(dotted: str) -> type:
    """The class `dotted` (module.Class) names; WorkerError if it cannot be imported."""
    module_name, _, class_name = dotted.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise WorkerError(f"--worker-extension-cls {dotted}: cannot import it ({exc})") from exc
    if not isinstance(found, type):
        raise WorkerError(f"--worker-extension-cls {dotted}: not a class")
    return found


def host_extension(dotted: str, worker: CpuWorker, loop: asyncio.AbstractEventLoop,
                   local_rank: int = 0) -> Any:
    """An instance of extension class `dotted` mixed with CpuSurface."""
    extension = extension_class(dotted)
    host_class: Any = type(f"Cpu{extension.__name__}", (CpuSurface, extension), {})
    try:
        host = host_class.__new__(host_class, local_rank=local_rank)
    except DynamodError as exc:  # e.g. its receiver cannot bind
        raise WorkerError(f"--worker-extension-cls {dotted}: {exc}") from exc
    host.__init__(worker, loop)
    return host
