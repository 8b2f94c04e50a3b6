"""Registering admin route handlers: upstream's taint route, errors answered as upstream does."""

from __future__ import annotations

import logging
from typing import Any

from dynamod.workers.cpu.admission import RouteHandler

log = logging.getLogger("dynamod.workers.cpu")


def upstream_taint_route(runtime: Any, endpoint: Any) -> RouteHandler:
    """dynamo.vllm's own `update/model_taints` handler, captured instead of registered."""
    from dynamo.common.model_taints import MODEL_TAINT_ROUTE, register_model_taint_route

    captured: dict[str, RouteHandler] = {}

    class _Capture:
        def register_engine_route(self, name: str, handler: RouteHandler) -> None:
            captured[name] = handler

    register_model_taint_route(_Capture(), endpoint)  # type: ignore[arg-type]
    return captured[MODEL_TAINT_ROUTE]


def catching(name: str, handler: RouteHandler) -> RouteHandler:
    """An unexpected failure answers `{"status": "error"}`, as upstream's RL handlers do."""

    async def answer(body: Any) -> dict[str, Any]:
        try:
            return await handler(body)
        except Exception as exc:
            log.exception("[RL] %s failed", name)
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}

    return answer
