"""Clients for the Dynamo pieces the supervisor talks to (checked against Dynamo 1.6.1).

- etcd registrations: a worker registers `v1/instances/{ns}/{component}/{endpoint}/{id:x}` for
  every endpoint it serves, plus `v1/mdc/...` (its model card), `v1/event_channels/...` and
  `v1/event_sources/...`. All of them hang on one etcd lease whose id *is* the instance id
  (lease TTL 30 s, kept alive by the worker). Revoking that lease deletes them in one step, and
  the frontend, which watches the prefix, drops the worker at once.
- the worker's system port (`DYN_SYSTEM_PORT`): `GET /health`, `GET /metrics`, and the engine
  admin routes `POST /engine/<route>`.
- the frontend: `GET /v1/models`, and `GET /health`, which lists the instances it can route to.

The instance value (JSON) looks like:
    {"type": "Endpoint", "namespace": "dynamo", "component": "backend", "endpoint": "generate",
     "instance_id": 2357531240335834376,
     "transport": {"tcp": "192.0.2.2:44607/20b7a22c1f1a7d08/dynamo/backend/generate"},
     "device_type": "cuda", "request_plane_codec": "msgpack"}
`transport` has exactly one key, "tcp" or "nats_tcp"; its address is not a stable parse target.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dynamod.core.errors import DynamodError
from dynamod.rollout.etcd import EtcdClient

if TYPE_CHECKING:
    from dynamod.rollout.worker_table import DynamoFrontendProbe

INSTANCES_ROOT = "v1/instances"
GENERATE_ENDPOINT = "generate"
DEFAULT_HTTP_TIMEOUT_S = 2.0
# Weight loads on a GPU worker take tens of seconds; the route answers only when done.
DEFAULT_ENGINE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DynamoInstance:
    """One registered endpoint instance of a Dynamo worker."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    lease_id: int  # the etcd lease the key hangs on; equals instance_id in Dynamo 1.6.1
    transport: str  # "tcp" or "nats_tcp"; "" if the value did not say
    address: str  # transport-specific, e.g. "host:port/instance_hex/ns/component/endpoint"
    key: str

    @property
    def instance_hex(self) -> str:
        return format(self.instance_id, "x")


class ProbeOutcome(NamedTuple):
    """A readiness verdict; unpacks as `ok, detail`."""

    ok: bool
    detail: str


class EngineRouteError(DynamodError):
    """A worker engine admin route (`POST /engine/<route>`) failed or answered an error."""

    def __init__(self, url: str, route: str, status: int | None, body: str) -> None:
        super().__init__(url, route, status, body)
        self.url = url
        self.route = route
        self.status = status
        self.body = body

    def __str__(self) -> str:
        got = f"HTTP {self.status}" if self.status is not None else "no HTTP answer"
        return f"engine route {self.route!r} at {self.url} failed: {got}: {self.body[:500]}"


class DynamoHTTPError(DynamodError):
    """A Dynamo HTTP endpoint (frontend or worker system port) did not answer as expected."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(url, detail)
        self.url = url
        self.detail = detail

    def __str__(self) -> str:
        return f"GET {self.url} failed: {self.detail}"


# -- etcd registrations ---------------------------------------------------------------------


def parse_instance(key: str, value: bytes, lease: int) -> DynamoInstance | None:
    """Parse one `v1/instances/...` entry; None if the key is not an instance key.

    The key path is authoritative for namespace/component/endpoint/id; the JSON value adds the
    transport. A value that is not the expected JSON still yields the instance (keyed by path).
    """
    parts = key.split("/")
    if len(parts) != 6 or "/".join(parts[:2]) != INSTANCES_ROOT:
        return None
    _, _, namespace, component, endpoint, instance_hex = parts
    try:
        instance_id = int(instance_hex, 16)
    except ValueError:
        return None
    transport, address = "", ""
    try:
        data = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        transport, address = _transport_of(data)
    return DynamoInstance(
        namespace=namespace,
        component=component,
        endpoint=endpoint,
        instance_id=instance_id,
        lease_id=lease,
        transport=transport,
        address=address,
        key=key,
    )


def _transport_of(data: dict[str, Any]) -> tuple[str, str]:
    transport = data.get("transport")
    if isinstance(transport, dict) and len(transport) == 1:
        ((kind, address),) = transport.items()
        return str(kind), str(address)
    return "", ""


async def list_instances(
    etcd: EtcdClient, namespace: str, endpoint: str | None = None
) -> list[DynamoInstance]:
    """Every registered instance in `namespace` (optionally only one endpoint name)."""
    kvs = await etcd.get_prefix(f"{INSTANCES_ROOT}/{namespace}/")
    instances = [
        inst
        for kv in kvs
        if (inst := parse_instance(kv.key, kv.value, kv.lease)) is not None
        and (endpoint is None or inst.endpoint == endpoint)
    ]
    return sorted(instances, key=lambda i: (i.component, i.endpoint, i.instance_id))


async def revoke_instance(etcd: EtcdClient, instance_id: int) -> list[str]:
    """Deregister a worker at once by revoking its etcd lease; returns the keys that went away.

    The lease is taken from the worker's own registrations (every `v1/instances` key carries
    the lease it hangs on); in Dynamo 1.6.1 that lease id equals the instance id, which is the
    fallback when the worker has no instance key left. Revoking deletes all the worker's keys
    (instances, mdc, event channels) in one etcd transaction, and the frontend's watch sees the
    deletions immediately. Idempotent: an already-gone lease returns [].
    """
    registered = await etcd.get_prefix(f"{INSTANCES_ROOT}/")
    leases = {
        inst.lease_id
        for kv in registered
        if (inst := parse_instance(kv.key, kv.value, kv.lease)) is not None
        and inst.instance_id == instance_id
        and inst.lease_id
    } or {instance_id}
    removed: list[str] = []
    for lease_id in sorted(leases):
        info = await etcd.lease_time_to_live(lease_id)
        if await etcd.lease_revoke(lease_id) and info is not None:
            removed.extend(info.keys)
    return sorted(removed)


async def withdraw_instance(
    etcd: EtcdClient, namespace: str, instance_ids: set[int], endpoint: str = GENERATE_ENDPOINT
) -> list[str]:
    """Take a live worker out of the frontend's routing: delete its `endpoint` instance
    keys and nothing else, as the worker's own `unregister_endpoint_instance` does (what
    dynamo.vllm calls before it sleeps or shuts down). Its lease, its model card and the
    streams it serves stay; the frontend's watch drops it from the instances its router
    picks from. Returns the keys deleted."""
    deleted = []
    for inst in await list_instances(etcd, namespace, endpoint):
        mine = inst.instance_id in instance_ids or inst.lease_id in instance_ids
        if mine and await etcd.delete(inst.key):
            deleted.append(inst.key)
    return deleted


# -- which instance ids belong to which worker process ---------------------------------------

_NOT_IN_A_METRIC_NAME = re.compile(r"[^A-Za-z0-9_]")


def namespace_label(namespace: str) -> str:
    """`namespace` as the runtime writes it in its metrics' `dynamo_namespace` label: it
    turns what a Prometheus name may not hold into `_` (namespace `local-serve` is labelled
    `local_serve`, while its etcd keys keep `local-serve`)."""
    return _NOT_IN_A_METRIC_NAME.sub("_", namespace)


def metric_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text, by prometheus_client's parser. A line it refuses
    costs that line, not the text: then each line is read on its own."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        found: list[Sample] = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                found += [s for f in text_string_to_metric_families(line + "\n") for s in f.samples]
        return found


def worker_ids_in_metrics(metrics_text: str, namespace: str) -> set[int]:
    """Instance ids found in the `worker_id` label of a worker's Prometheus metrics."""
    ids: set[int] = set()
    label = namespace_label(namespace)
    for sample in metric_samples(metrics_text):
        worker, ns = sample.labels.get("worker_id"), sample.labels.get("dynamo_namespace")
        if worker and ns is not None and namespace_label(ns) == label:
            with contextlib.suppress(ValueError):  # not hex: no instance id
                ids.add(int(worker, 16))
    return ids


async def instance_ids_for_worker(
    session: aiohttp.ClientSession,
    etcd: EtcdClient,
    namespace: str,
    system_url: str,
    timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
) -> list[int]:
    """The instance ids currently registered in etcd by the worker behind `system_url`.

    Why this is reliable: the supervisor gives every worker its own system port
    (`DYN_SYSTEM_PORT`), so the port identifies the process. The Dynamo runtime labels every
    metric an endpoint creates with `worker_id` = the instance id in hex (the etcd lease id;
    `prometheus_names.labels.WORKER_ID`, injected by the Rust runtime in `create_metric()`), so
    the worker's own `GET /metrics` names its instance id. That is runtime code shared by every
    engine (mocker, dynamo.vllm, sglang, trtllm), not engine code. The ids are intersected with
    `v1/instances/{namespace}/` so only live registrations are returned: [] means "not
    registered (yet)". Ask while the worker is alive, i.e. right after it turns ready, and
    remember the answer: after a SIGKILL the port is gone but the registration may linger.

    `GET /health` does not carry the id (only endpoint names and their health), and the etcd
    value carries no pid or port; the `v1/mdc` model card embeds the system URL only while
    metadata self-hosting is on (DYN_SELF_HOST_METADATA, default on), so it is not relied on.
    """
    url = f"{system_url.rstrip('/')}/metrics"
    text = await _get_text(session, url, timeout_s)
    candidates = worker_ids_in_metrics(text, namespace)
    if not candidates:
        return []
    registered = {inst.instance_id for inst in await list_instances(etcd, namespace)}
    return sorted(candidates & registered)


# -- frontend --------------------------------------------------------------------------------


async def frontend_models(
    session: aiohttp.ClientSession, frontend_url: str, timeout_s: float = DEFAULT_HTTP_TIMEOUT_S
) -> list[str]:
    """Model names the frontend serves (`GET /v1/models`)."""
    url = f"{frontend_url.rstrip('/')}/v1/models"
    data = await _get_json(session, url, timeout_s)
    entries = data.get("data")
    if not isinstance(entries, list):
        raise DynamoHTTPError(url, f"no 'data' list in {json.dumps(data)[:300]}")
    return [str(e["id"]) for e in entries if isinstance(e, dict) and "id" in e]


async def frontend_routed_instances(
    session: aiohttp.ClientSession,
    frontend_url: str,
    namespace: str,
    endpoint: str = GENERATE_ENDPOINT,
    timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
) -> set[int]:
    """Instance ids the frontend currently knows for `endpoint` in `namespace`.

    The frontend's `GET /health` lists the instances registered in etcd (the same JSON as
    the etcd values), the keys its router's discovery watch follows for the set it picks
    from: a revoked lease disappears from both within milliseconds; a SIGKILLed worker stays
    until its lease expires (20-30 s), meanwhile each failed connect only benches it for 5
    s, so some requests keep failing with 503 unless the frontend runs with
    `--migration-limit`. Dynamo 1.6.1 reads the list from etcd per call: a frontend whose
    etcd member is cut off answers late, and one whose read failed answers an empty list,
    as if it had no instance at all; `frontend_routed_checked` tells the two apart.
    """
    url = f"{frontend_url.rstrip('/')}/health"
    data = await _get_json(session, url, timeout_s)
    instances = data.get("instances")
    if not isinstance(instances, list):
        raise DynamoHTTPError(url, f"no 'instances' list in {json.dumps(data)[:300]}")
    return {
        int(i["instance_id"])
        for i in instances
        if isinstance(i, dict)
        and i.get("namespace") == namespace
        and i.get("endpoint") == endpoint
        and "instance_id" in i
    }


async def frontend_routed_checked(
    session: aiohttp.ClientSession,
    frontend_url: str,
    namespace: str,
    etcd: EtcdClient,
    timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
) -> set[int]:
    """`frontend_routed_instances`, an empty answer checked against etcd
    (`confirm_unrouted`). A list that names any instance is taken as it is."""
    routed = await frontend_routed_instances(session, frontend_url, namespace, timeout_s=timeout_s)
    if not routed:
        await confirm_unrouted(frontend_url, namespace, etcd)
    return routed


async def confirm_unrouted(frontend_url: str, namespace: str, etcd: EtcdClient) -> None:
    """A frontend whose own etcd read failed answers an empty list: an empty list while
    etcd holds `generate` instances in `namespace` raises DynamoHTTPError (no answer)
    instead of saying that the frontend routes nothing."""
    held = await list_instances(etcd, namespace, GENERATE_ENDPOINT)
    if held:
        raise DynamoHTTPError(
            f"{frontend_url.rstrip('/')}/health",
            f"it listed no instance in {namespace!r} while etcd holds {len(held)} "
            "(its own etcd read failed, or has not seen them yet)",
        )


async def frontend_readiness(
    session: aiohttp.ClientSession,
    frontend_url: str,
    namespace: str,
    model: str,
    min_instances: int,
    timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
    current: set[int] | None = None,
) -> ProbeOutcome:
    """Ready = the frontend's own discovery view holds at least `min_instances` `generate`
    instances in `namespace` AND lists `model` in `/v1/models`. (`GET /health` answers 200
    with no workers, so its status code alone means nothing.) The frontend's view, not etcd's,
    is what its router picks from, so that is what is counted. Given `current` (the instance
    ids of the stack's live workers), only those count: a dead worker's registration that is
    still in the view is not a ready instance.
    """
    try:
        routed = await frontend_routed_instances(
            session, frontend_url, namespace, timeout_s=timeout_s
        )
        counted = routed if current is None else routed & current
        count = len(counted)
        instance_part = (
            f"{count}/{min_instances} generate instances in namespace {namespace} "
            "in the frontend's view"
        )
        if current is not None:
            instance_part += " (of the stack's live workers"
            others = len(routed - current)
            instance_part += f"; {others} other(s) not counted)" if others else ")"
        if not routed:  # Dynamo answers an empty list when its own etcd read fails
            instance_part += " (it listed none: no worker registered, or its own etcd read failed)"
    except DynamoHTTPError as err:
        count = -1
        instance_part = f"cannot read the frontend's instances: {err}"
    try:
        models = await frontend_models(session, frontend_url, timeout_s)
        model_ok = model in models
        verdict = "listed in" if model_ok else "not in"
        model_part = f"model {model!r} {verdict} {frontend_url}/v1/models (saw {models})"
    except DynamoHTTPError as err:
        model_ok = False
        model_part = f"model {model!r} unknown: {err}"
    ok = count >= min_instances and model_ok
    return ProbeOutcome(ok=ok, detail=f"{instance_part}; {model_part}")


async def frontend_ready(
    session: aiohttp.ClientSession,
    spec: DynamoFrontendProbe,
    current: set[int] | None = None,
) -> ProbeOutcome:
    """`frontend_readiness` for a `dynamo_frontend` probe spec (used by `probes.py`)."""
    return await frontend_readiness(
        session, spec.url, spec.namespace, spec.model, spec.min_instances, spec.timeout, current
    )


# -- worker engine admin routes --------------------------------------------------------------


async def engine_call(
    session: aiohttp.ClientSession,
    system_url: str,
    route: str,
    payload: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
) -> dict[str, Any]:
    """`POST /engine/<route>` on a worker's system port; returns the JSON reply.

    Dynamo serves these with HTTP 200 whatever the handler returns, so a reply with
    `"status": "error"` is an error too; a handler that raises gives HTTP 500
    `{"error": "Handler error", "message": ...}`, an unknown route HTTP 404.
    """
    url = f"{system_url.rstrip('/')}/engine/{route.lstrip('/')}"
    try:
        async with session.post(
            url, json=payload or {}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            status = resp.status
            body = await resp.text()
    except TimeoutError:
        raise EngineRouteError(url, route, None, f"no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as err:
        raise EngineRouteError(url, route, None, f"cannot reach worker ({err})") from None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = None
    if status != 200 or not isinstance(data, dict) or data.get("status") == "error":
        raise EngineRouteError(url, route, status, body)
    return data


# -- HTTP helpers ----------------------------------------------------------------------------


async def _get_text(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise DynamoHTTPError(url, f"HTTP {resp.status}: {body[:300]}")
            return body
    except TimeoutError:
        raise DynamoHTTPError(url, f"no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as err:
        raise DynamoHTTPError(url, f"cannot connect ({err})") from None


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any]:
    body = await _get_text(session, url, timeout_s)
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        raise DynamoHTTPError(url, f"not JSON: {body[:300]!r}") from None
    if not isinstance(data, dict):
        raise DynamoHTTPError(url, f"expected a JSON object, got {body[:300]!r}")
    return data
