"""The `dynamo_frontend` readiness probe: the frontend's own discovery view holds the
expected `generate` instances and `/v1/models` lists the model (its `/health` is 200 with
zero workers, so that alone means nothing). Registered with the core's probe registry.
While a daemon runs Dynamo workers, only the instances of its live workers count (the
registrations extension provides them), so a dead worker's leftover registration never
makes the frontend look ready, and a probe that fails names the running workers that have
no registration (the operator's first question when the frontend never becomes ready)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import aiohttp

from dynamod.core.probes import ProbeContext, Prober, ProbeResult, register_prober, timed
from dynamod.rollout import dynamo
from dynamod.rollout.worker_table import DynamoFrontendProbe

CurrentInstances = Callable[[str], set[int]]  # namespace -> live workers' instance ids
Unregistered = Callable[[str], list[str]]  # namespace -> running workers with no registration
_current: CurrentInstances | None = None
_unregistered: Unregistered | None = None


def count_only(provider: CurrentInstances | None, unregistered: Unregistered | None = None) -> None:
    """Count only the instances `provider` names (None: every instance in the view);
    `unregistered` names the workers a failing probe should point at."""
    global _current, _unregistered
    _current, _unregistered = provider, unregistered


class DynamoFrontendProber:
    def __init__(self, spec: DynamoFrontendProbe, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self.session = session

    async def check(self) -> ProbeResult:
        current = _current(self.spec.namespace) if _current is not None else None
        result = await timed(self.spec, dynamo.frontend_ready(self.session, self.spec, current))
        missing = _unregistered(self.spec.namespace) if _unregistered is not None else []
        if not result.ok and missing:
            named = f"{result.detail}; running without a Dynamo registration: {', '.join(missing)}"
            return dataclasses.replace(result, detail=named)
        return result

    def close(self) -> None:
        pass


def _make(spec: DynamoFrontendProbe, ctx: ProbeContext) -> Prober:
    return DynamoFrontendProber(spec, ctx.session)


def register() -> None:
    register_prober(DynamoFrontendProbe, _make)
