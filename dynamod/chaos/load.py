"""Load for a chaos run: concurrent completion clients at a bounded rate, a share of them
trainer-style (requiring the current policy's taint), each answer recorded with its send
and finish times, status, serving instance and weight version (`nvext.extra_fields`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from dynamod.chaos.history import Request
from dynamod.chaos.model import Load


class LoadGenerator:
    def __init__(self, spec: Load, url: Callable[[], str], model: str, origin: float,
                 current_version: Callable[[], int | None]) -> None:
        self.spec = spec
        self.url = url  # asked per request: a restarted daemon allocates the frontend anew
        self.model = model
        self.origin = origin
        self.current_version = current_version
        self.requests: list[Request] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._random = random.Random(11)

    def _now(self) -> float:
        return time.monotonic() - self.origin

    def body(self, prompt: str, required: int | None) -> dict[str, Any]:
        fields = ["worker_id", "engine_data"]
        if self.spec.logprobs:
            fields.append("completion_token_ids")
        nvext: dict[str, Any] = {"extra_fields": fields}
        if required is not None:
            nvext["routing_constraints"] = {"required_taints": [f"dynamod.policy/{required}"]}
        body: dict[str, Any] = {"model": self.model, "prompt": prompt,
                                "max_tokens": self.spec.max_tokens, "nvext": nvext}
        if self.spec.logprobs:
            body["logprobs"] = 1
        return body

    async def one(self, session: aiohttp.ClientSession, prompt: str) -> Request:
        trainer = self._random.random() < self.spec.trainer_fraction
        required = self.current_version() if trainer else None
        sent = self._now()
        version = instance = error = None
        tokens: dict[str, Any] = {}
        try:
            async with session.post(f"{self.url()}/v1/completions",
                                    json=self.body(prompt, required)) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            status, text = -1, repr(exc)
        if status == 200:
            try:
                answer = json.loads(text)
                nvext = answer.get("nvext") or {}
                engine = nvext.get("engine_data") or {}
                version = engine.get("weight_version")
                # dynamo.vllm 1.6.1 returns no engine_data: then the router's pick
                served = engine.get("instance_id",
                                    (nvext.get("worker_id") or {}).get("decode_worker_id"))
                instance = None if served is None else str(served)
                tokens = _token_counts(answer)
            except (ValueError, AttributeError, IndexError):
                error = f"unparsable 200 answer: {text[:100]}"
        else:
            error = text[:200]
        row = Request(sent=sent, done=self._now(), status=status, required=required,
                      version=version, instance=instance, error=error, **tokens)
        self.requests.append(row)
        return row

    async def _client(self, session: aiohttp.ClientSession, interval: float,
                      prompts: itertools.cycle[str]) -> None:
        next_at = time.monotonic() + self._random.uniform(0, interval)
        while not self._stop.is_set():
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            await self.one(session, next(prompts))

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.spec.request_timeout)
        interval = self.spec.clients / self.spec.rate
        prompts = itertools.cycle(self.spec.prompts)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, interval, prompts)
                                   for _ in range(self.spec.clients)))

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()),
                                        name="chaos-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.spec.request_timeout + 5)

    def recent_error_rate(self, window: float) -> float:
        since = self._now() - window
        recent = [r for r in list(self.requests) if r.done >= since]
        return sum(not r.ok for r in recent) / len(recent) if len(recent) >= 5 else 0.0


def _token_counts(answer: dict[str, Any]) -> dict[str, Any]:
    """How many token ids, logprobs and usage tokens the answer carries, and how it ended."""
    choice = (answer.get("choices") or [{}])[0]
    ids = (answer.get("nvext") or {}).get("completion_token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    return {"finish": choice.get("finish_reason"),
            "token_ids": len(ids) if isinstance(ids, list) else None,
            "logprobs": len(logprobs) if isinstance(logprobs, list) else None,
            "usage_tokens": (answer.get("usage") or {}).get("completion_tokens")}
