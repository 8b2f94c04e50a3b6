"""`DynamodWorkerExtension`: the shard side of the colocated weight update, for `dynamo.vllm`.

vLLM mixes it into its GPU worker (`--worker-extension-cls
dynamod.integrations.verl.worker_extension.DynamodWorkerExtension`, a vLLM engine argument
that `dynamo.vllm` passes through). When the worker's unit sets DYNAMOD_WEIGHT_IPC_DIR
(and dynamod's DYNAMOD_UNIT marker names the shard), creating the worker starts a
`WeightReceiver` sidecar bound at `<dir>/<unit>.rank<local_rank>.sock`. Each bucket the
trainer sends is loaded with the model's own `load_weights` (which copies out of the
shared buffer); the acknowledgement carries the step and the digest of what arrived.
The shard must be paused while that runs (the trainer side pauses it first), as for
`update_weights_from_disk`. What this needs of vLLM is written as Protocols below, so
nothing here imports vLLM; the CPU worker hosts the same class through its own surface
(dynamod/workers/cpu/extension.py), which is how the path is tested without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog
import torch

from dynamod.integrations.verl.ipc import WeightReceiver, address_from_env

log = structlog.get_logger("dynamod.integrations.verl.worker_extension")

DIGEST_ENV = "DYNAMOD_WEIGHT_DIGEST"  # "0": no digest in the acknowledgement (saves a D2H copy)


class _Model(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class _ModelRunner(Protocol):
    model: _Model
    model_config: Any  # vLLM's ModelConfig (the in-place reload's finalize reads its dtype)


class DynamodWorkerExtension:
    """Mixed into vLLM's worker; `model_runner` and `device` are the worker's."""

    model_runner: _ModelRunner
    device: torch.device | None
    _dynamod_receiver: WeightReceiver | None
    _dynamod_loaded: int
    _dynamod_reload: tuple[Callable[..., Any], Callable[..., Any]] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> DynamodWorkerExtension:
        instance: DynamodWorkerExtension = super().__new__(cls)
        instance._dynamod_receiver = None
        instance._dynamod_loaded = 0
        instance._dynamod_reload = None
        address = address_from_env(int(kwargs.get("local_rank", 0) or 0))
        if address is not None:
            device = torch.device("cuda", int(kwargs.get("local_rank", 0) or 0)) \
                if torch.cuda.is_available() else None
            receiver = WeightReceiver(address, _Loader(instance), device=device,
                                      digest=os.environ.get(DIGEST_ENV, "1") != "0")
            receiver.start()
            instance._dynamod_receiver = receiver
        return instance

    # The receiver's calls, on its thread. A host (the CPU worker) overrides them.

    def dynamod_begin_update(self, step: int) -> None:
        self._dynamod_loaded = 0
        self._dynamod_reload = _layerwise_reload()
        if self._dynamod_reload is not None:
            self._dynamod_reload[0](self.model_runner.model)

    def dynamod_load_bucket(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.model.load_weights(weights=weights)
        self._dynamod_loaded += len(weights)

    def dynamod_finish_update(self, step: int, digest: str) -> dict[str, Any]:
        reload, self._dynamod_reload = self._dynamod_reload, None
        if reload is not None:
            reload[1](self.model_runner.model, self.model_runner.model_config)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"loaded": self._dynamod_loaded}

    def dynamod_abort_update(self, reason: str) -> None:
        # vLLM's parameters already hold the buckets loaded so far (with vLLM's in-place
        # reload begun and not finalized); the shard reports no new version, so dynamod
        # holds it and replays the step from its checkpoint (update_weights_from_disk,
        # whose own reload takes up the layers this one left).
        self._dynamod_reload = None
        log.warning("verl.ipc_update_aborted", reason=reason, loaded=self._dynamod_loaded)

    def dynamod_close(self) -> None:
        if self._dynamod_receiver is not None:
            self._dynamod_receiver.close()
            self._dynamod_receiver = None


def _layerwise_reload() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """vLLM's in-place reload (initialize, then load_weights per bucket, then finalize), as
    its own update_weights_from_disk does in vLLM 0.31; None where vLLM has none (older
    vLLM, or the CPU worker hosting this class). Without it, load_weights into a loaded
    vLLM 0.31 model fails: its parameters lost their loaders after the first load
    (`'Parameter' object has no attribute 'weight_loader'`, seen on dynamo.vllm on CPU)."""
    try:
        from vllm.model_executor.model_loader.reload import (  # type: ignore[import-not-found]
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class _Loader:
    """The receiver's UpdateLoader, forwarding to the extension's overridable methods."""

    def __init__(self, worker: DynamodWorkerExtension) -> None:
        self.worker = worker

    def begin(self, step: int) -> None:
        self.worker.dynamod_begin_update(step)

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.worker.dynamod_load_bucket(weights)

    def finish(self, step: int, digest: str) -> dict[str, Any]:
        return self.worker.dynamod_finish_update(step, digest)

    def abort(self, reason: str) -> None:
        self.worker.dynamod_abort_update(reason)
