"""verl's generate call as one OpenAI completions request to the frontend, and back.

Request: the prompt as token ids, verl's sampling parameters, `logprobs: 0` when verl asks
for log-probabilities (the sampled token's only, as vLLM's `SamplingParams(logprobs=0)`),
and `nvext` with the policy's routing constraint (`required_taints`: the kv router gives
the request only to a shard verified at that version) and the extra fields to return:
`completion_token_ids` (the engine's own ids, when `request_completion_token_ids`) and
`engine_data` (the serving shard's weight version and instance).

Response: token ids from `nvext.completion_token_ids` (or `token_id:N` strings in
`choices[0].logprobs.tokens`), log-probabilities from `choices[0].logprobs.token_logprobs`,
in order and of equal length or the response is refused; the finish reason becomes verl's
stop reason ('completed' or 'aborted'). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamod.integrations.verl.config import RolloutSettings
from dynamod.integrations.verl.errors import GenerationError

TAINT_PREFIX = "dynamod.policy/"
ABORTED_REASONS = {"abort", "aborted", "cancelled", "canceled"}
_DROPPED = {"logprobs", "prompt_logprobs", "max_new_tokens", "nvext", "n"}


def policy_taint(version: int) -> str:
    return f"{TAINT_PREFIX}{version}"


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str | None
    finish_reason: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def max_tokens_for(sampling_params: Mapping[str, Any], prompt_len: int,
                   prompt_length: int, response_length: int) -> int:
    """verl's budget: the caller's max_tokens, else what the response length leaves."""
    given = sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens")
    if given is not None:
        return int(given)
    return max(0, min(response_length, prompt_length + response_length - prompt_len))


def build_request(
    *,
    model: str,
    prompt_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    max_tokens: int,
    version: int,
    settings: RolloutSettings,
    request_id: str,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_tokens),
        "stream": False,
    }
    for key, value in sampling_params.items():
        if key in _DROPPED or key == "max_tokens" or value is None:
            continue
        if key == "top_k" and int(value) <= 0:
            continue  # vLLM's "disabled"; the frontend wants it absent
        body[key] = value
    if (
        sampling_params.get("logprobs")
        or settings.return_tokens_as_token_ids
        or settings.force_logprobs_for_token_ids
    ):
        body["logprobs"] = 0
    if settings.return_tokens_as_token_ids:
        body["return_tokens_as_token_ids"] = True
    if settings.include_payload_request_id:
        body["request_id"] = request_id
    extra_fields = []
    if settings.request_completion_token_ids:
        extra_fields.append("completion_token_ids")
    if settings.request_engine_data:
        extra_fields.append("engine_data")
    caller = sampling_params.get("nvext")
    nvext: dict[str, Any] = dict(caller) if isinstance(caller, Mapping) else {}
    nvext["extra_fields"] = sorted({*nvext.get("extra_fields", []), *extra_fields, "worker_id"})
    constraints = dict(nvext.get("routing_constraints") or {})
    constraints["required_taints"] = [policy_taint(version)]
    nvext["routing_constraints"] = constraints
    body["nvext"] = nvext
    return body


def _token_strings(tokens: Any) -> list[int] | None:
    if not isinstance(tokens, list) or not tokens:
        return None
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith("token_id:"):
            return None
        ids.append(int(token.split(":", 1)[1]))
    return ids


def parse_response(body: Any, *, want_log_probs: bool, version: int) -> Completion:
    """The completion verl consumes; GenerationError for a body it cannot trust."""
    if not isinstance(body, Mapping) or not body.get("choices"):
        raise GenerationError(f"frontend answered without choices: {str(body)[:300]}")
    choice: Mapping[str, Any] = body["choices"][0]
    nvext: Mapping[str, Any] = body.get("nvext") or {}
    logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), Mapping) else {}
    token_ids: list[int] | None = None
    if nvext.get("completion_token_ids") is not None:
        token_ids = [int(t) for t in nvext["completion_token_ids"]]
    else:
        token_ids = _token_strings((logprobs or {}).get("tokens"))
    if token_ids is None:
        raise GenerationError(
            "the frontend returned no completion token ids (neither nvext.completion_token_ids "
            "nor token_id:N logprob tokens); keep request_completion_token_ids=true"
        )
    log_probs: list[float] | None = None
    values = (logprobs or {}).get("token_logprobs")
    if values is not None:
        log_probs = [float(v) if v is not None else float("nan") for v in values]
        if len(log_probs) != len(token_ids):
            raise GenerationError(
                f"{len(token_ids)} completion token ids but {len(log_probs)} logprobs: token "
                "ids and logprobs must match in length and order"
            )
    elif want_log_probs and token_ids:
        log_probs = None  # the engine returned none; verl sees None, not invented values
    finish = choice.get("finish_reason")
    stop = "aborted" if finish in ABORTED_REASONS else ("completed" if finish else None)
    engine: Mapping[str, Any] = nvext.get("engine_data") or {}
    served = engine.get("weight_version")
    extra: dict[str, Any] = {
        "global_steps": served if isinstance(served, int) else version,
        "required_version": version,
        "weight_version": served,
        "instance_id": engine.get("instance_id"),
        "worker_id": (nvext.get("worker_id") or {}).get("decode_worker_id"),
    }
    return Completion(token_ids, log_probs, stop, finish, extra)
