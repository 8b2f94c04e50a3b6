"""The `dynamo_frontend` readiness probe: the frontend's own discovery view holds the
expected `generate` instances and `/v1/models` lists the model (its `/health` is 200 with
zero workers, so that alone means nothing). Registered with the core's probe registry."""

from __future__ import annotations

import aiohttp

from dynamod.core.probes import ProbeContext, Prober, ProbeResult, register_prober, timed
from dynamod.core.spec import DynamoFrontendProbe
from dynamod.rollout import dynamo


class DynamoFrontendProber:
    def __init__(self, spec: DynamoFrontendProbe, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self.session = session

    async def check(self) -> ProbeResult:
        return await timed(self.spec, dynamo.frontend_ready(self.session, self.spec))

    def close(self) -> None:
        pass


def _make(spec: DynamoFrontendProbe, ctx: ProbeContext) -> Prober:
    return DynamoFrontendProber(spec, ctx.session)


def register() -> None:
    register_prober(DynamoFrontendProbe, _make)
