"""The worker extension's update inside vLLM (pure: vLLM's reload module stood in): on a
vLLM that has the in-place reload (0.31), the buckets load between its initialize and its
finalize, as update_weights_from_disk does; without it, load_weights alone."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from dynamod.integrations.verl.worker_extension import DynamodWorkerExtension

RELOAD = "vllm.model_executor.model_loader.reload"


class _Worker(DynamodWorkerExtension):
    def __init__(self, calls: list[Any]) -> None:
        def load_weights(weights: list[Any]) -> None:
            calls.append(("load", len(weights)))

        model = types.SimpleNamespace(load_weights=load_weights)
        self.model_runner = types.SimpleNamespace(model=model, model_config="cfg")  # type: ignore[assignment]
        self.device = None


def _update(calls: list[Any]) -> dict[str, Any]:
    worker = _Worker(calls)
    worker.dynamod_begin_update(3)
    worker.dynamod_load_bucket([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    worker.dynamod_load_bucket([("c", torch.zeros(1))])
    return worker.dynamod_finish_update(3, "d")


def test_buckets_load_inside_vllms_in_place_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    module = types.ModuleType(RELOAD)
    module.initialize_layerwise_reload = lambda model: calls.append("initialize")  # type: ignore[attr-defined]
    module.finalize_layerwise_reload = lambda model, config: calls.append(("finalize", config))  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, RELOAD, module)
    assert _update(calls) == {"loaded": 3}
    assert calls == ["initialize", ("load", 2), ("load", 1), ("finalize", "cfg")]


def test_without_vllms_reload_the_buckets_load_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, RELOAD, None)  # an import of it raises ImportError
    calls: list[Any] = []
    assert _update(calls) == {"loaded": 3}
    assert calls == [("load", 2), ("load", 1)]
