"""The rollout server verl's agent loop calls: one Ray actor per replica, no engine inside.

`generate(request_id, prompt_ids, sampling_params)` reads the ledger's current version
from dynamod, sends one completions request to the frontend requiring that version's
taint, and returns verl's `TokenOutput` (completion token ids, their logprobs, the stop
reason, and the serving shard's weight version as `global_steps`). A 500 with a required
taint means no admitted shard holds the version yet (an update is landing, or the shard
is being replayed) and a refused connection that the frontend is restarting: the request
is sent again at the version read then, until `retry_window_s` (default 60 s) has passed.
Lifecycle calls fan out to this replica's shards (`engine.py`), on the node the actor runs
on (`layout.py`); `reach` checks, before verl uses the actor, that the frontend answers
from there. Counters keep completed, aborted, retried and failed attempts apart, for the
validation's first boundary.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from dynamod.integrations.verl import completions, engine
from dynamod.integrations.verl.config import RolloutSettings
from dynamod.integrations.verl.errors import GenerationError, StackNotReadyError

log = structlog.get_logger("dynamod.integrations.verl")

RETRY_DELAY_S = 0.2  # grows by this much per attempt, up to MAX_RETRY_DELAY_S
MAX_RETRY_DELAY_S = 2.0


class DynamodRolloutServer:
    """State: the stack's state dir, this replica's rank, the settings; nothing cached
    that a restart could make stale except the frontend address (the unit's port is
    allocated once per `up`)."""

    def __init__(
        self,
        state_dir: str,
        settings: RolloutSettings,
        replica_rank: int,
        replicas: int,
        model: str,
        frontend_url: str,
        prompt_length: int,
        response_length: int,
        free_cache_engine: bool = True,
        node: str | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.settings = settings
        self.replica_rank = replica_rank
        self.replicas = replicas
        self.model = model
        self.node = node  # the cluster node this actor was placed on (None: one node)
        self.frontend_url = frontend_url
        self.url = f"{frontend_url}/v1/completions"
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.free_cache_engine = free_cache_engine
        self.counts: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def reach(self) -> None:
        """StackNotReadyError unless the frontend answers `/live` from where this runs."""
        url = f"{self.frontend_url}/live"
        try:
            async with self._http().get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return
                why = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        on = f" of node {self.node}" if self.node is not None else ""
        raise StackNotReadyError(
            f"rollout replica {self.replica_rank}{on}: the frontend at {url} does not answer "
            f"({why}); a replica on another node than the head reaches the head's frontend "
            "only where it listens beyond loopback: start the cluster with "
            "--var frontend_host=0.0.0.0"
        )

    async def current_version(self) -> int:
        from dynamod.client import Client

        answer = await asyncio.to_thread(Client(self.state_dir).policy_status)
        return int(answer["current"])

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None:
            raise GenerationError("the dynamod rollout backend serves text prompts only")
        completion = await self.complete(request_id, prompt_ids, sampling_params)
        return TokenOutput(
            token_ids=completion.token_ids,
            log_probs=completion.log_probs,
            stop_reason=completion.stop_reason,
            extra_fields=completion.extra,
        )

    async def complete(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> completions.Completion:
        max_tokens = completions.max_tokens_for(
            sampling_params, len(prompt_ids), self.prompt_length, self.response_length
        )
        last = ""
        attempt = 0
        deadline = time.monotonic() + self.settings.retry_window_s
        while True:
            attempt += 1
            version = await self.current_version()
            body = completions.build_request(
                model=self.model, prompt_ids=prompt_ids, sampling_params=sampling_params,
                max_tokens=max_tokens, version=version, settings=self.settings,
                request_id=request_id,
            )
            try:
                async with self._http().post(self.url, json=body) as resp:
                    status, answer = resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                status, answer, last = 0, None, f"{type(exc).__name__}: {exc}"
            if status == 200:
                completion = completions.parse_response(
                    answer, want_log_probs=bool(sampling_params.get("logprobs")),
                    version=version,
                )
                self.counts["aborted" if completion.stop_reason == "aborted" else "completed"] += 1
                return completion
            if status:
                last = f"HTTP {status}: {str(answer)[:300]}"
            delay = min(RETRY_DELAY_S * attempt, MAX_RETRY_DELAY_S)
            if 400 <= status < 500 or time.monotonic() + delay > deadline:
                break
            self.counts["retried"] += 1
            log.warning("verl.generate_retry", request_id=request_id, attempt=attempt,
                        required=completions.policy_taint(version), error=last)
            await asyncio.sleep(delay)
        self.counts["failed"] += 1
        raise GenerationError(
            f"request {request_id} failed after {attempt} attempt(s) in "
            f"{self.settings.retry_window_s:g} s at {self.url} (last: {last}); a 500 with a "
            "required taint means no admitted shard holds the current policy version: see "
            "`dynamod policy status`; a refused connection, that the frontend is down "
            "(`dynamod status`)"
        )

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    # ---------------------------------------------------------------- lifecycle

    async def _lifecycle(self, call: str) -> list[dict[str, Any]]:
        return await engine.replica_call(
            self._http(), self.state_dir, self.replica_rank, self.replicas, call
        )

    async def wake_up(self) -> list[dict[str, Any]]:
        return await self._lifecycle("wake_up")

    async def sleep(self) -> list[dict[str, Any]]:
        """verl sleeps the replicas after each generation to free their memory for the
        update, and wakes them through the adapter's `resume` only when
        `rollout.free_cache_engine` is set: without it a slept shard would refuse the
        update, so the shards stay awake."""
        if not self.free_cache_engine:
            log.info("verl.sleep_skipped", reason="rollout.free_cache_engine is false")
            return []
        return await self._lifecycle("sleep")

    async def clear_kv_cache(self) -> list[dict[str, Any]]:
        return await self._lifecycle("clear_kv_cache")

    async def release_kv_cache(self) -> list[dict[str, Any]]:
        return await self._lifecycle("release_kv_cache")

    async def resume_kv_cache(self) -> list[dict[str, Any]]:
        return []  # a flushed cache refills on use; there is nothing to map back in

    async def abort_all_requests(self, reject_request: bool = False) -> list[dict[str, Any]]:
        if reject_request:
            log.warning("verl.reject_request_ignored",
                        reason="paused shards hold new requests until resume_generation")
        return await self._lifecycle("abort_all_requests")

    async def resume_generation(self) -> list[dict[str, Any]]:
        return await self._lifecycle("resume_generation")

    async def start_profile(self, **kwargs: Any) -> None:
        log.info("verl.profile_not_supported", call="start_profile")

    async def stop_profile(self) -> None:
        log.info("verl.profile_not_supported", call="stop_profile")
