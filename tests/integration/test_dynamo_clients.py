"""dynamod.rollout.dynamo against a real stack: etcd, NATS, the Dynamo frontend and Dynamo mocker
workers (Dynamo 1.6.1, CPU). The tests share one stack and run in file order: the first one
checks readiness before any worker exists."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import aiohttp
import pytest

from dynamod.core.ports import PortAllocator
from dynamod.core.state import UnitState
from dynamod.rollout import dynamo
from dynamod.rollout import registrations as registrations_module
from dynamod.rollout.etcd import EtcdClient
from dynamod.rollout.registrations import DynamoRegistrations
from dynamod.rollout.worker_table import DynamoFrontendProbe, DynamoWorkerSpec
from tests.integration.rawstack import RawStack, Worker, http_json, raw_stack

# Below 32768: Dynamo refuses a larger DYN_SYSTEM_PORT.
free_port = free_system_port = PortAllocator()

MODEL = "tiny"
NAMESPACE = "dynclients"

T = TypeVar("T")


class Stack:
    """etcd + NATS + frontend, and mocker workers started on demand (kept for the module)."""

    def __init__(self, raw: RawStack, model_dir: Path) -> None:
        self.raw = raw
        self.model_dir = model_dir
        self.workers: dict[str, Worker] = {}

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.raw.etcd_port}"

    def worker(self, name: str) -> Worker:
        if name not in self.workers:
            port = free_system_port()
            env = {
                **self.raw.dynamo_env(),
                "DYN_SYSTEM_ENABLED": "true",
                "DYN_SYSTEM_HOST": "127.0.0.1",
                "DYN_SYSTEM_PORT": str(port),
                "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
            }
            argv = [
                sys.executable,
                "-m",
                "dynamo.mocker",
                "--model-path",
                str(self.model_dir),
                "--model-name",
                MODEL,
                "--discovery-backend",
                "etcd",
            ]
            worker = Worker(self.raw.spawn(f"mocker-{name}", argv, env), port)
            worker.proc.wait_until("worker /health 200", lambda: worker.health()[0] == 200, 60)
            self.workers[name] = worker
        return self.workers[name]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("dynclients")
    model_dir = root / "model"
    subprocess.run(
        [sys.executable, "-m", "dynamod.workers.model", str(model_dir)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with raw_stack(root, NAMESPACE) as raw:
        raw.start_etcd()
        raw.start_nats()  # as units/nats.toml: no JetStream (the TCP request plane needs none)
        raw.start_frontend(router_mode="kv")
        yield Stack(raw, model_dir)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def etcd(stack: Stack) -> AsyncIterator[EtcdClient]:
    async with EtcdClient(stack.etcd_url) as client:
        yield client


async def until(
    what: str, probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout: float = 60
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s; last seen: {value!r}")
        await asyncio.sleep(0.1)


# -- pure parsing, on values captured from Dynamo 1.6.1 ---------------------------------------

INSTANCE_VALUE = (
    b'{"type":"Endpoint","component":"backend","endpoint":"generate","namespace":"dynamo",'
    b'"instance_id":2357531240335834376,"transport":{"tcp":"192.0.2.2:44607/20b7a22c1f1a7d08/'
    b'dynamo/backend/generate"},"device_type":"cuda","request_plane_codec":"msgpack"}'
)


def test_parse_instance_reads_path_and_transport() -> None:
    key = "v1/instances/dynamo/backend/generate/20b7a22c1f1a7d08"
    inst = dynamo.parse_instance(key, INSTANCE_VALUE, 2357531240335834376)
    assert inst == dynamo.DynamoInstance(
        namespace="dynamo",
        component="backend",
        endpoint="generate",
        instance_id=2357531240335834376,
        lease_id=2357531240335834376,
        transport="tcp",
        address="192.0.2.2:44607/20b7a22c1f1a7d08/dynamo/backend/generate",
        key=key,
    )
    assert inst.instance_hex == "20b7a22c1f1a7d08"
    # A value that is not JSON still yields the instance, keyed by its path alone.
    assert dynamo.parse_instance(key, b"not json", 7) == dynamo.DynamoInstance(
        namespace="dynamo", component="backend", endpoint="generate",
        instance_id=0x20B7A22C1F1A7D08, lease_id=7, transport="", address="", key=key,
    )
    assert dynamo.parse_instance("v1/mdc/dynamo/backend/generate/20b7a22c1f1a7d08", b"", 0) is None


def test_worker_ids_in_metrics_filters_by_namespace() -> None:
    text = textwrap.dedent("""\
        # HELP dynamo_component_inflight_requests Number of requests
        dynamo_component_inflight_requests{dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo",worker_id="20b7a22c1f1a7d08"} 0
        dynamo_component_inflight_requests{dynamo_component="backend",dynamo_namespace="other",worker_id="ff"} 0
        dynamo_work_handler_pool_capacity 10000
        """)  # noqa: E501
    assert dynamo.worker_ids_in_metrics(text, "dynamo") == {0x20B7A22C1F1A7D08}


# -- against the real stack -------------------------------------------------------------------


@pytest.mark.slow
async def test_frontend_readiness_waits_for_instances_and_model(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    url = stack.raw.frontend_url

    async def readiness(n: int) -> dynamo.ProbeOutcome:
        return await dynamo.frontend_readiness(session, url, NAMESPACE, MODEL, n)

    assert stack.workers == {}, "this test must run first, before any worker exists"
    before = await readiness(1)
    assert before == (
        False,
        f"0/1 generate instances in namespace {NAMESPACE} in the frontend's view (it listed "
        "none: no worker registered, or its own etcd read failed); "
        f"model 'tiny' not in {url}/v1/models (saw [])",
    )

    stack.worker("a")
    after = await until("frontend ready", lambda: readiness(1), lambda o: o.ok)
    assert after.detail == (
        f"1/1 generate instances in namespace {NAMESPACE} in the frontend's view; "
        f"model 'tiny' listed in {url}/v1/models (saw ['tiny'])"
    )
    short = await readiness(2)
    assert not short.ok
    assert short.detail.startswith(f"1/2 generate instances in namespace {NAMESPACE} in")


@pytest.mark.slow
async def test_frontend_readiness_names_what_is_unreachable(
    session: aiohttp.ClientSession,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    outcome = await dynamo.frontend_readiness(session, dead, NAMESPACE, MODEL, 1, 0.5)
    assert not outcome.ok
    assert f"cannot read the frontend's instances: GET {dead}/health failed" in outcome.detail
    assert f"model 'tiny' unknown: GET {dead}/v1/models failed: cannot connect" in outcome.detail


@pytest.mark.slow
async def test_list_instances_and_instance_id_mapping(
    stack: Stack, session: aiohttp.ClientSession, etcd: EtcdClient
) -> None:
    a, b = stack.worker("a"), stack.worker("b")
    ids_a = await until(
        "worker a registered",
        lambda: dynamo.instance_ids_for_worker(session, etcd, NAMESPACE, a.system_url),
        bool,
    )
    ids_b = await until(
        "worker b registered",
        lambda: dynamo.instance_ids_for_worker(session, etcd, NAMESPACE, b.system_url),
        bool,
    )
    assert len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b

    generate = await dynamo.list_instances(etcd, NAMESPACE, "generate")
    assert sorted(i.instance_id for i in generate) == sorted(ids_a + ids_b)
    for inst in generate:
        assert inst.lease_id == inst.instance_id  # one lease per worker, id == instance id
        assert inst.key == f"v1/instances/{NAMESPACE}/backend/generate/{inst.instance_hex}"
        assert inst.transport == "tcp" and inst.instance_hex in inst.address
    everything = await dynamo.list_instances(etcd, NAMESPACE)
    assert {i.instance_id for i in everything} == set(ids_a + ids_b)

    # The frontend's own metrics carry its lease id, but it registers no instance.
    assert (
        await dynamo.instance_ids_for_worker(session, etcd, NAMESPACE, stack.raw.frontend_url) == []
    )
    routed = await until(
        "frontend knows both workers",
        lambda: dynamo.frontend_routed_instances(session, stack.raw.frontend_url, NAMESPACE),
        lambda ids: len(ids) == 2,
    )
    assert routed == set(ids_a + ids_b)


@pytest.mark.slow
async def test_revoke_instance_drops_a_killed_worker_at_once(
    stack: Stack, session: aiohttp.ClientSession, etcd: EtcdClient
) -> None:
    a, b = stack.worker("a"), stack.worker("b")
    (id_a,) = await dynamo.instance_ids_for_worker(session, etcd, NAMESPACE, a.system_url)
    (id_b,) = await dynamo.instance_ids_for_worker(session, etcd, NAMESPACE, b.system_url)
    frontend = stack.raw.frontend_url

    b.proc.signal_group(signal.SIGKILL)
    b.proc.popen.wait(10)
    stack.raw.procs.remove(b.proc)
    del stack.workers["b"]
    # Without revocation the registration outlives the process by up to the lease TTL (30 s).
    assert id_b in {i.instance_id for i in await dynamo.list_instances(etcd, NAMESPACE)}

    started = time.monotonic()
    removed = await dynamo.revoke_instance(etcd, id_b)
    hex_b = format(id_b, "x")
    assert f"v1/instances/{NAMESPACE}/backend/generate/{hex_b}" in removed
    assert f"v1/mdc/{NAMESPACE}/backend/generate/{hex_b}" in removed
    assert all(hex_b in key or key.startswith("v1/event_") for key in removed)
    assert {i.instance_id for i in await dynamo.list_instances(etcd, NAMESPACE)} == {id_a}

    routed = await until(
        "frontend drops the revoked worker",
        lambda: dynamo.frontend_routed_instances(session, frontend, NAMESPACE),
        lambda ids: ids == {id_a},
        timeout=10,
    )
    # "at once": well inside the 30 s lease a dead worker's registration would outlive
    assert routed == {id_a} and time.monotonic() - started < 10

    for _ in range(8):
        async with session.post(
            f"{frontend}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hello",
                "max_tokens": 2,
                "nvext": {"extra_fields": ["worker_id"]},
            },
        ) as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
        assert body["nvext"]["worker_id"]["decode_worker_id"] == id_a

    assert await dynamo.revoke_instance(etcd, id_b) == []  # idempotent


@pytest.mark.slow
async def test_engine_call_error_carries_url_route_and_body(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    a = stack.worker("a")  # the mocker registers no /engine routes
    with pytest.raises(dynamo.EngineRouteError) as caught:
        await dynamo.engine_call(session, a.system_url, "flush_cache", {})
    err = caught.value
    assert (err.url, err.route, err.status) == (
        f"{a.system_url}/engine/flush_cache",
        "flush_cache",
        404,
    )
    assert "Route /engine/flush_cache not found" in err.body and err.url in str(err)


ROUTES_SCRIPT = """
import asyncio
from dynamo.runtime import DistributedRuntime

async def ok(body):
    return {"status": "ok", "echo": body}

async def refuse(body):
    return {"status": "error", "message": "Worker must be paused"}

async def crash(body):
    raise ValueError("kaboom")

async def main():
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp")
    for name, handler in [("ok", ok), ("refuse", refuse), ("control/crash", crash)]:
        runtime.register_engine_route(name, handler)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.slow
async def test_engine_call_against_dynamo_system_server(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """Real Dynamo route semantics: HTTP 200 even for a `"status": "error"` reply, 500 when
    the handler raises, text/plain content type on JSON bodies."""
    port = free_system_port()
    env = {
        **stack.raw.dynamo_env(),
        "DYN_SYSTEM_ENABLED": "true",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_SYSTEM_PORT": str(port),
    }
    proc = stack.raw.spawn("routes", [sys.executable, "-c", ROUTES_SCRIPT], env)
    url = f"http://127.0.0.1:{port}"

    async def probe() -> int:
        try:
            await dynamo.engine_call(session, url, "ok", {"x": 1}, timeout_s=1)
        except dynamo.EngineRouteError as err:
            return -1 if err.status is None else err.status
        return 200

    try:
        await until("routes served", probe, lambda status: status == 200, timeout=30)
        assert await dynamo.engine_call(session, url, "ok", {"x": 1}) == {
            "status": "ok",
            "echo": {"x": 1},
        }

        with pytest.raises(dynamo.EngineRouteError) as refused:
            await dynamo.engine_call(session, url, "refuse")
        assert refused.value.status == 200 and "Worker must be paused" in refused.value.body

        with pytest.raises(dynamo.EngineRouteError) as crashed:
            await dynamo.engine_call(session, url, "control/crash", {})
        assert crashed.value.status == 500 and "ValueError: kaboom" in crashed.value.body
        assert f"{url}/engine/control/crash" in str(crashed.value)
    finally:
        proc.stop()
        stack.raw.procs.remove(proc)


@pytest.mark.slow
async def test_an_empty_health_list_is_checked_against_etcd(
    stack: Stack,
    session: aiohttp.ClientSession,
    etcd: EtcdClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frontend whose own etcd read fails answers `/health` with an empty instance list
    (Dynamo 1.6.1), as if it routed nothing: `frontend_routed_checked` takes that for no
    answer while etcd holds instances, and for "none" where etcd holds none either. The
    frontend reads etcd through the fault proxy, which the test takes down."""
    stack.worker("a")
    held = {i.instance_id for i in await dynamo.list_instances(etcd, NAMESPACE, "generate")}
    assert held
    listen, control, http = free_port(), free_port(), free_port()
    upstream = f"127.0.0.1:{stack.raw.etcd_port}"
    proxy = stack.raw.spawn("etcd-proxy", [sys.executable, "-m", "dynamod.chaos.proxy",
                                           "--listen", str(listen), "--control", str(control),
                                           "--upstream", upstream])  # fmt: skip
    faults = f"http://127.0.0.1:{control}/faults"
    proxy.wait_until("the proxy's control port", lambda: http_json("GET", faults)[0] == 200, 30)
    env = {**stack.raw.dynamo_env(), "ETCD_ENDPOINTS": f"http://127.0.0.1:{listen}",
           "ETCD_LEASE_TTL": "300"}  # fmt: skip
    argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
            "--http-port", str(http), "--discovery-backend", "etcd"]  # fmt: skip
    frontend = stack.raw.spawn("frontend-proxied", argv, env)
    url = f"http://127.0.0.1:{http}"
    try:
        await until("the proxied frontend lists the workers",
                    lambda: _routed_or_none(session, url), lambda ids: ids == held)  # fmt: skip
        assert await dynamo.frontend_routed_checked(session, url, NAMESPACE, etcd) == held
        assert http_json("POST", faults, {"down": True})[0] == 200
        await until("its etcd read fails: an empty list",
                    lambda: _routed_or_none(session, url), lambda ids: ids == set())  # fmt: skip
        with pytest.raises(dynamo.DynamoHTTPError, match=f"while etcd holds {len(held)}"):
            await dynamo.frontend_routed_checked(session, url, NAMESPACE, etcd)
        # dynamod's own readers: `routed` unknown, not false; a withdraw not "dropped"
        registrations = _registrations(stack, session, url)
        assert await registrations._routed_views() == {}
        monkeypatch.setattr(registrations_module, "_WITHDRAW_WAIT_S", 1.0)
        seen = await registrations._until_unrouted(NAMESPACE, set(held), etcd)
        assert seen.startswith(f"still listed by {url}"), seen
        # where etcd holds none either, the empty list is the answer
        assert await dynamo.frontend_routed_checked(session, url, "nothing-here", etcd) == set()
        assert http_json("POST", faults, {"down": False})[0] == 200
        await until("it lists the workers again",
                    lambda: _routed_or_none(session, url), lambda ids: ids == held)  # fmt: skip
        assert await registrations._routed_views() == {NAMESPACE: held}
        assert frontend.alive()  # it lived through its etcd's outage
    finally:
        for proc in (frontend, proxy):
            proc.stop()
            stack.raw.procs.remove(proc)


async def _routed_or_none(session: aiohttp.ClientSession, url: str) -> set[int] | None:
    try:
        return await dynamo.frontend_routed_instances(session, url, NAMESPACE, timeout_s=5)
    except (TimeoutError, dynamo.DynamoHTTPError, aiohttp.ClientError):
        return None


def _registrations(stack: Stack, session: aiohttp.ClientSession, url: str) -> DynamoRegistrations:
    """dynamod's registrations extension over a host with two units: a ready frontend at
    `url` and a worker of NAMESPACE on the stack's etcd."""
    probe = DynamoFrontendProbe(kind="dynamo_frontend", url=url, namespace=NAMESPACE,
                                model=MODEL)  # fmt: skip
    table = DynamoWorkerSpec(etcd=stack.etcd_url, namespace=NAMESPACE,
                             system_url="http://127.0.0.1:1")  # fmt: skip
    ready = UnitState.READY
    units = {
        "frontend": SimpleNamespace(spec=SimpleNamespace(ready=probe, tables={}), state=ready),
        "worker": SimpleNamespace(
            spec=SimpleNamespace(ready=None, tables={"dynamo": table}), state=ready
        ),
    }
    registrations = DynamoRegistrations()
    registrations.host = SimpleNamespace(engine=SimpleNamespace(session=session, units=units))  # type: ignore[assignment]
    return registrations
