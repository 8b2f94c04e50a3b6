"""What the worker serves beside completions: its admin route handlers (upstream's taint
route, errors answered as upstream does) and its prefix-cache counters as Prometheus text
for the system port's `/metrics`, under vLLM's own names so a reader of dynamo.vllm's
metrics reads ours unchanged."""

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


# vLLM's prefix-cache counters (prompt tokens looked up / found cached), as dynamo.vllm's
# system port shows them; a reader sums them over the workers.
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prefix_cache_metrics(stats: dict[str, Any], model_name: str) -> str:
    """The engine's prefix-cache counts (`engine.stats()`) as Prometheus exposition text;
    empty for an engine without a prefix cache (the mocker)."""
    cache = stats.get("prefix_cache")
    if not isinstance(cache, dict):
        return ""
    labels = f'{{model_name="{_label(model_name)}",engine="{_label(stats.get("engine", ""))}"}}'
    lines = []
    for name, key, what in ((PREFIX_QUERIES, "queried_tokens", "Prefix cache queries, in tokens"),
                            (PREFIX_HITS, "hit_tokens", "Prefix cache hits, in tokens")):
        lines += [f"# HELP {name} {what}.", f"# TYPE {name} counter",
                  f"{name}_total{labels} {int(cache[key])}"]
    return "\n".join(lines) + "\n"
