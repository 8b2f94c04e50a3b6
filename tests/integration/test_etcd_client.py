"""dynamod.rollout.etcd against a real etcd (the JSON gateway of etcd 3.5)."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from dynamod.rollout.etcd import EtcdClient, EtcdError, prefix_range_end
from tests.integration.rawstack import free_port, raw_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("etcd-client")
    with raw_stack(root) as stack:
        stack.start_etcd()
        yield f"http://127.0.0.1:{stack.etcd_port}"


@pytest.fixture
async def etcd(etcd_url: str) -> AsyncIterator[EtcdClient]:
    async with EtcdClient(etcd_url) as client:
        yield client


@pytest.fixture
def prefix() -> str:
    """Every test writes under its own prefix, so tests never see each other's keys."""
    return f"test/{uuid.uuid4().hex}/"


async def test_put_get_and_missing_key(etcd: EtcdClient, prefix: str) -> None:
    await etcd.put(f"{prefix}a", b"\x00\xffbinary")
    await etcd.put(f"{prefix}b", "text")
    assert await etcd.get(f"{prefix}a") == b"\x00\xffbinary"
    assert await etcd.get(f"{prefix}b") == b"text"
    assert await etcd.get(f"{prefix}missing") is None

    kv = await etcd.get_kv(f"{prefix}b")
    assert kv is not None and kv.key == f"{prefix}b" and kv.lease == 0 and kv.mod_revision > 0


async def test_get_prefix_stays_inside_the_prefix(etcd: EtcdClient, prefix: str) -> None:
    await etcd.put(f"{prefix}x/1", "1")
    await etcd.put(f"{prefix}x/2", "2")
    await etcd.put(f"{prefix}x0", "sibling sorts right after the prefix")
    await etcd.put(f"{prefix}w", "sibling sorts before")

    kvs = await etcd.get_prefix(f"{prefix}x/")
    assert [(kv.key, kv.value) for kv in kvs] == [(f"{prefix}x/1", b"1"), (f"{prefix}x/2", b"2")]
    assert await etcd.get_prefix(f"{prefix}nothing/") == []


async def test_delete_and_delete_prefix_report_counts(etcd: EtcdClient, prefix: str) -> None:
    for name in ("d/1", "d/2", "d/3", "keep"):
        await etcd.put(f"{prefix}{name}", name)

    assert await etcd.delete(f"{prefix}d/1") == 1
    assert await etcd.delete(f"{prefix}d/1") == 0
    assert await etcd.delete_prefix(f"{prefix}d/") == 2
    assert [kv.key for kv in await etcd.get_prefix(prefix)] == [f"{prefix}keep"]


async def test_put_if_is_compare_and_swap_on_mod_revision(etcd: EtcdClient, prefix: str) -> None:
    key = f"{prefix}ledger"
    assert await etcd.put_if(key, "v1", expected_mod_revision=0)  # create only if absent
    assert not await etcd.put_if(key, "again", expected_mod_revision=0)

    kv = await etcd.get_kv(key)
    assert kv is not None and kv.value == b"v1"
    assert await etcd.put_if(key, "v2", expected_mod_revision=kv.mod_revision)
    assert not await etcd.put_if(key, "stale writer", expected_mod_revision=kv.mod_revision)
    assert await etcd.get(key) == b"v2"


async def test_lease_keys_go_with_the_lease_and_revoke_is_idempotent(
    etcd: EtcdClient, prefix: str
) -> None:
    lease = await etcd.lease_grant(30)
    await etcd.put(f"{prefix}l/1", "a", lease=lease)
    await etcd.put(f"{prefix}l/2", "b", lease=lease)

    kv = await etcd.get_kv(f"{prefix}l/1")
    assert kv is not None and kv.lease == lease
    info = await etcd.lease_time_to_live(lease)
    assert info is not None and info.granted_ttl == 30 and 0 < info.ttl <= 30
    assert info.keys == [f"{prefix}l/1", f"{prefix}l/2"]

    assert await etcd.lease_revoke(lease) is True
    assert await etcd.get_prefix(f"{prefix}l/") == []
    assert await etcd.lease_time_to_live(lease) is None
    assert await etcd.lease_revoke(lease) is False  # already gone: not an error
    assert await etcd.lease_revoke(0x7FFF_0000_0000_0001) is False  # never existed


async def test_server_refusal_names_operation_key_and_server_message(
    etcd: EtcdClient, prefix: str
) -> None:
    with pytest.raises(EtcdError) as caught:
        await etcd.put(f"{prefix}orphan", "x", lease=0x7FFF_0000_0000_0002)
    err = caught.value
    assert (err.operation, err.key, err.endpoint) == ("put", f"{prefix}orphan", etcd.endpoint)
    assert "lease not found" in err.detail
    assert str(err).startswith(f"etcd put '{prefix}orphan' at {etcd.endpoint} failed: HTTP 404")


async def test_unreachable_endpoint_names_the_endpoint() -> None:
    port = free_port()  # bound and released: nothing listens there
    async with EtcdClient(f"127.0.0.1:{port}") as client:
        with pytest.raises(EtcdError) as caught:
            await client.get("some/key")
    err = caught.value
    assert err.endpoint == f"http://127.0.0.1:{port}"
    assert f"http://127.0.0.1:{port}" in str(err)
    assert "'some/key'" in str(err) and "cannot reach etcd" in str(err)


async def test_silent_endpoint_times_out_per_request() -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        async with EtcdClient(url, timeout_s=0.3) as client:
            started = asyncio.get_running_loop().time()
            with pytest.raises(EtcdError, match=r"no answer within 0\.3 s"):
                await client.lease_grant(5)
            assert asyncio.get_running_loop().time() - started < 2


async def test_shared_session_is_left_open(etcd_url: str, prefix: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with EtcdClient(etcd_url, session=session) as client:
            await client.put(f"{prefix}k", "v")
        assert not session.closed
        async with EtcdClient(etcd_url, session=session) as client:
            assert await client.get(f"{prefix}k") == b"v"


def test_prefix_range_end() -> None:
    assert prefix_range_end("a/") == b"a0"
    assert prefix_range_end("a\xff") == "a\xff".encode()[:-1] + b"\xc0"
    assert prefix_range_end("") == b"\0"
