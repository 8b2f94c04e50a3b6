"""Rollouts through the Dynamo frontend, pinned to the ledger's current policy version.

Every request is a `/v1/completions` call with the prompt as token ids and
`nvext.routing_constraints.required_taints = ["dynamod.policy/<v>"]`, where v is the
ledger's version read just before sending: the kv router only picks a shard that was
verified at v, and a request no shard can take fails instead of reaching a stale one.
`nvext.extra_fields` asks for

* `completion_token_ids`: the sampled ids (the tiny model's text is often not valid UTF-8);
* `engine_data`: the worker's `weight_version`, `weight_digest` and `instance_id` at
  admission (dynamod.workers.cpu adds them to every chunk);
* `worker_id`: the router's pick (differs from `instance_id` only after a migration).

It also asks for the sampled tokens' logprobs (`"logprobs": 0`, OpenAI's
`choices[0].logprobs.token_logprobs`) for the trainer's boundary check, and sends a
seed derived from the run's seed, the step and the sample, so a run is reproducible.

The frontend serves one choice per request (`n` is not honoured), so a group of G
completions is G requests. Each request is recorded in the history file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from dynamod.core.errors import DynamodError
from dynamod.trainer.control import Control
from dynamod.trainer.history import HistoryWriter, RequestRecord

log = structlog.get_logger("dynamod.trainer")

TAINT_PREFIX = "dynamod.policy/"
EXTRA_FIELDS = ["completion_token_ids", "engine_data", "worker_id"]
MAX_IN_FLIGHT = 32
RETRY_DELAY_S = 0.5
RETRY_DELAY_MAX_S = 4.0


class RolloutError(DynamodError):
    """A request could not be served; says what was sent and what came back."""


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample: int
    prompt_ids: list[int]
    token_ids: list[int]  # as the engine returned them
    version: int | str | None  # the weight version that served it
    shard: str | None
    reward: float
    logprobs: list[float] | None = None  # the engine's, one per token
    finish_reason: str | None = None
    migrated: bool = False  # the tokens came from another shard than the router's pick

    @property
    def cancelled(self) -> bool:
        """Aborted (a pause in abort mode) or migrated: not the engine's own ending."""
        return self.migrated or self.finish_reason in {"cancelled", "abort"}


@dataclass(frozen=True)
class _Reply:
    status: int
    body: Any


class Rollouts:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        control: Control,
        history: HistoryWriter,
        *,
        frontend: str,
        model: str,
        max_tokens: int,
        attempts: int,
        encode: Callable[[str], list[int]],
        reward: Callable[[list[int]], float],
        seed: int = 0,
    ) -> None:
        self.session = session
        self.control = control
        self.history = history
        self.url = f"{frontend}/v1/completions"
        self.model = model
        self.max_tokens = max_tokens
        self.attempts = attempts
        self.encode = encode  # used only when the frontend returns text without ids
        self.reward = reward
        self.seed = seed
        self.round = 0  # set by the loop: the step (or eval round) being rolled out
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def groups(
        self, prompts: list[list[int]], group_size: int, phase: str
    ) -> list[list[Completion]]:
        """`group_size` completions for each prompt (all requests in flight together)."""
        tasks = [
            [self.one(p, s, ids, phase) for s in range(group_size)] for p, ids in enumerate(prompts)
        ]
        flat = await asyncio.gather(*(t for group in tasks for t in group))
        return [list(flat[i * group_size : (i + 1) * group_size]) for i in range(len(prompts))]

    async def one(
        self, prompt_index: int, sample: int, prompt: list[int], phase: str
    ) -> Completion:
        delay = RETRY_DELAY_S
        last = ""
        for attempt in range(1, self.attempts + 1):
            reply: _Reply | None = None
            async with self._slots:
                version = await self.control.current_version()
                taint = f"{TAINT_PREFIX}{version}"
                started, sent_at = time.monotonic(), time.time()
                try:
                    reply = await self._post(prompt, taint, self._seed(prompt_index, sample))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
            request = {
                "requested_at": sent_at,
                "phase": phase,
                "ledger_version": version,
                "required_version": version,
                "required_taint": taint,
                "prompt_index": prompt_index,
                "sample": sample,
                "attempt": attempt,
                "http_status": reply.status if reply else None,
                "latency_ms": round((time.monotonic() - started) * 1000, 1),
            }
            if reply is not None and reply.status == 200 and isinstance(reply.body, dict):
                return await self._accept(reply.body, request, prompt)
            if reply is not None:
                last = f"HTTP {reply.status}: {str(reply.body)[:300]}"
            self._record(request, error=last)
            if reply is not None and 400 <= reply.status < 500:
                break  # the request itself is wrong; sending it again will not help
            if attempt < self.attempts:
                log.warning(
                    "trainer.request_retry", attempt=attempt, taint=taint, error=last, delay=delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_DELAY_MAX_S)
        raise RolloutError(
            f"completion for prompt {prompt_index} sample {sample} failed after "
            f"{attempt} attempt(s) at {self.url} (last: {last}); a 500 with a required "
            "taint means no admitted shard holds the current version: see "
            "`dynamod policy status` and the workers' logs"
        )

    def _seed(self, prompt_index: int, sample: int) -> int:
        return (self.seed * 1_000_003 + self.round * 10_007 + prompt_index * 101 + sample) % (
            1 << 31
        )

    async def _post(self, prompt: list[int], taint: str, seed: int) -> _Reply:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "nvext": {
                "routing_constraints": {"required_taints": [taint]},
                "extra_fields": EXTRA_FIELDS,
            },
        }
        async with self.session.post(self.url, json=body) as resp:
            text = await resp.text()
        try:
            return _Reply(resp.status, json.loads(text))
        except ValueError:
            return _Reply(resp.status, text)

    def _record(self, request: dict[str, Any], **outcome: Any) -> None:
        fields: dict[str, Any] = {
            "ok": False,
            "error": None,
            "served_version": None,
            "served_digest": None,
            "instance_id": None,
            "routed_worker_id": None,
            "shard": None,
            "completion_tokens": 0,
            "reward": None,
            **request,
            **outcome,
        }
        self.history.write(RequestRecord(**fields))

    async def _accept(
        self, body: dict[str, Any], request: dict[str, Any], prompt: list[int]
    ) -> Completion:
        nvext = body.get("nvext") or {}
        engine = nvext.get("engine_data") or {}
        token_ids = nvext.get("completion_token_ids")
        if token_ids is None:
            token_ids = self.encode(body["choices"][0].get("text") or "")
        tokens = [int(t) for t in token_ids]
        choice = body["choices"][0]
        raw_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        logprobs = None if raw_logprobs is None else [float(x) for x in raw_logprobs]
        instance = engine.get("instance_id")
        routed = (nvext.get("worker_id") or {}).get("decode_worker_id")
        shard = await self.control.shard_of(instance)
        reward = self.reward(tokens)
        self._record(
            request,
            ok=True,
            served_version=engine.get("weight_version"),
            served_digest=engine.get("weight_digest"),
            instance_id=instance,
            routed_worker_id=routed,
            shard=shard,
            completion_tokens=len(tokens),
            reward=reward,
        )
        return Completion(
            request["prompt_index"],
            request["sample"],
            prompt,
            tokens,
            engine.get("weight_version"),
            shard,
            reward,
            logprobs=logprobs,
            finish_reason=choice.get("finish_reason"),
            migrated=routed is not None and instance is not None and routed != instance,
        )
