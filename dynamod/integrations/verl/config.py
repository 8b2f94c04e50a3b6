"""The rollout's settings under `actor_rollout_ref.rollout.engine_kwargs.dynamod` (or the
recipe's `...engine_kwargs.dynamo`), checked key by key.

verl-recipe's Dynamo backend reads its settings from `engine_kwargs.dynamo`. Under dynamod
the stack file owns the processes, ports and router, so each recipe key is one of:

* kept: it still means something for the requests this backend sends;
* checked: it must agree with the running stack (namespace, model, router mode,
  ThunderAgent), or the rollout is refused with the key named;
* refused: dynamod owns it; setting it here would silently do nothing, so it is an error
  that says where it lives now;
* ignored: harmless and meaningless here; logged once with the reason.

Unknown keys are errors. Pure: no verl, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.integrations.verl.errors import RolloutConfigError

PREFIX = "actor_rollout_ref.rollout.engine_kwargs"
SECTIONS = ("dynamod", "dynamo")
ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")

_STACK_FILE = "the stack file (units/stacks/verl-*.toml)"
_ROUTER_TUNING = f"router tuning is the frontend unit's, in {_STACK_FILE}"
REFUSED: dict[str, str] = {
    "frontend_http_port": f"dynamod allocates the frontend's port; set it in {_STACK_FILE}",
    "etcd_port": f"dynamod runs etcd; its ports are in {_STACK_FILE}",
    "etcd_peer_port": f"dynamod runs etcd; its ports are in {_STACK_FILE}",
    "nats_port": f"dynamod runs NATS; its ports are in {_STACK_FILE}",
    "stable_kv_event_ports": f"the shards' KV-event ports are fixed in {_STACK_FILE}",
    "distributed_executor_backend": f"the shards' vLLM flags are in {_STACK_FILE}",
    "extra_args": f"the shards' command lines are in {_STACK_FILE}",
    "frontend_extra_args": f"the frontend's command line is in {_STACK_FILE}",
    "frontend_connection_limit": f"the frontend's flags are in {_STACK_FILE}",
    "router_predict_on_route": f"router tuning flags are the frontend unit's, in {_STACK_FILE}",
    "router_predicted_ttl_secs": f"router tuning flags are the frontend unit's, in {_STACK_FILE}",
    "enable_nemo_router_tuning": f"router tuning flags are the frontend unit's, in {_STACK_FILE}",
    "active_decode_blocks_threshold": _ROUTER_TUNING,
    "active_prefill_tokens_threshold": _ROUTER_TUNING,
    "active_prefill_tokens_threshold_frac": _ROUTER_TUNING,
    "direct_generate": "requests must go through the frontend, where the policy taint is "
    "enforced; direct calls to a shard would bypass the rejoin protocol",
    "direct_request_timeout_s": "direct generation is not available (see direct_generate)",
    "enable_rl": "the shards' RL mode is set in the stack file (DYN_ENABLE_RL)",
}
IGNORED: dict[str, str] = {
    "enable_worker_system_metrics": "the stack's kv-metrics unit scrapes every shard already",
    "free_engine_on_train": "verl's own sleep/wake_up calls reach the shards' control routes",
}
_THUNDERAGENT_REFUSED = {
    "router_block_size": "the ThunderAgent router's block size is the stack's var block_size",
    "extra_args": "the ThunderAgent router's command line is in the stack file",
}
_THUNDERAGENT_KEPT = {"enabled", "finalize_max_attempts", "finalize_retry_delay_s"}
_BOOLS = {
    "request_completion_token_ids",
    "request_engine_data",
    "return_tokens_as_token_ids",
    "force_logprobs_for_token_ids",
    "include_payload_request_id",
}
_STRINGS = {"namespace", "served_model_name", "router_mode", "state_dir", "checkpoint_dir",
            "ipc_dir", "run_name"}
_CHOICES = {"weight_sync": ("push", "ipc"), "checkpoint_write": ("background", "inline")}
_POSITIVE = {"request_timeout_s", "retry_window_s"}
_INTS = {"checkpoint_keep", "ipc_bucket_mb", "push_serving"}
KNOWN = _BOOLS | _STRINGS | _POSITIVE | _INTS | set(_CHOICES) | {"thunderagent"}


@dataclass(frozen=True)
class RolloutSettings:
    """What this backend does with each request, and what it expects of the stack."""

    state_dir: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_keep: int = 2
    # `policy push --serving K`: verl's update_weights returns once K shards serve the step
    # (the rest update after; trainer traffic requires the step). None: every shard.
    push_serving: int | None = None
    # How verl's update_weights reaches the shards: "push" (a checkpoint, `policy push`)
    # or "ipc" (the colocated transfer to the worker extension, then `policy publish`).
    weight_sync: str = "push"
    ipc_dir: Path | None = None  # default: <state_dir>/weight-ipc (the stacks' weight_ipc_dir)
    ipc_bucket_mb: int = 512
    checkpoint_write: str = "background"  # the ipc path's per-step replay checkpoint
    request_completion_token_ids: bool = True
    request_engine_data: bool = True
    return_tokens_as_token_ids: bool = False
    force_logprobs_for_token_ids: bool = False
    include_payload_request_id: bool = False
    request_timeout_s: float = 600.0
    # How long a request is retried while no shard serves the current version or the
    # frontend is down (a shard replayed, the frontend restarted by dynamod).
    retry_window_s: float = 60.0
    namespace: str | None = None
    served_model_name: str | None = None
    router_mode: str | None = None
    thunderagent: bool | None = None
    run_name: str | None = None  # recorded with each push; default: start time and pid
    ignored: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"0", "false", "no", "off"}:
        return False
    raise RolloutConfigError(key, f"expected a boolean, got {value!r}")


def parse_settings(engine_kwargs: Mapping[str, Any] | None) -> RolloutSettings:
    """Settings from `rollout.engine_kwargs`; RolloutConfigError names the first bad key."""
    engine_kwargs = engine_kwargs or {}
    present = [s for s in SECTIONS if engine_kwargs.get(s)]
    if len(present) > 1:
        raise RolloutConfigError(
            f"{PREFIX}.dynamo", "give the settings once, under engine_kwargs.dynamod or .dynamo"
        )
    if not present:
        return RolloutSettings()
    section = present[0]
    raw = engine_kwargs[section]
    where = f"{PREFIX}.{section}"
    if not isinstance(raw, Mapping):
        raise RolloutConfigError(where, f"expected a mapping, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    ignored: list[tuple[str, str]] = []
    for key, value in raw.items():
        name = f"{where}.{key}"
        if key in REFUSED:
            raise RolloutConfigError(name, f"owned by dynamod: {REFUSED[key]}")
        if key in IGNORED:
            ignored.append((name, IGNORED[key]))
            continue
        if key not in KNOWN:
            raise RolloutConfigError(
                name, "unknown key (known: " + ", ".join(sorted(KNOWN | set(IGNORED))) + ")"
            )
        if value is None:
            continue
        if key == "thunderagent":
            values["thunderagent"] = _thunderagent(name, value)
        elif key in _BOOLS:
            values[key] = _bool(name, value)
        elif key in _POSITIVE:
            number = _number(name, value)
            if number <= 0:
                raise RolloutConfigError(name, f"must be positive, got {value!r}")
            values[key] = number
        elif key in _INTS:
            values[key] = _int(name, value)
        elif key in {"state_dir", "checkpoint_dir", "ipc_dir"}:
            values[key] = Path(str(value))
        elif key in _CHOICES:
            if value not in _CHOICES[key]:
                raise RolloutConfigError(
                    name, f"{value!r} is not one of {', '.join(_CHOICES[key])}"
                )
            values[key] = value
        else:
            values[key] = str(value)
    mode = values.get("router_mode")
    if mode is not None and mode not in ROUTER_MODES:
        raise RolloutConfigError(
            f"{where}.router_mode", f"{mode!r} is not a router mode ({', '.join(ROUTER_MODES)})"
        )
    return RolloutSettings(**values, ignored=tuple(ignored))


def _thunderagent(where: str, value: Any) -> bool | None:
    if not isinstance(value, Mapping):
        raise RolloutConfigError(where, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if key in _THUNDERAGENT_REFUSED:
            raise RolloutConfigError(
                f"{where}.{key}", f"owned by dynamod: {_THUNDERAGENT_REFUSED[key]}"
            )
        if key not in _THUNDERAGENT_KEPT:
            raise RolloutConfigError(f"{where}.{key}", "unknown key")
    enabled = value.get("enabled")
    return None if enabled is None else _bool(f"{where}.enabled", enabled)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RolloutConfigError(key, f"expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise RolloutConfigError(key, f"expected a number, got {value!r}") from None


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RolloutConfigError(key, f"expected a positive integer, got {value!r}")
    return value
