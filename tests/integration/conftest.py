"""Fixtures the integration tests share."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dynamod.rollout.etcd import EtcdClient
from tests.integration.rawstack import raw_stack

# Without the verl extra its modules are not collected. It is found, not imported: `import
# verl` costs ~9 s of CPU (torch, ray, transformers, hydra) and every pytest worker
# collects every module, most of them never running a verl test.
collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["test_verl_*.py"]


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real etcd on loopback for the module that asks for it."""
    root: Path = tmp_path_factory.mktemp("etcd")
    with raw_stack(root) as stack:
        stack.start_etcd()
        yield f"http://127.0.0.1:{stack.etcd_port}"


@pytest.fixture
async def etcd(etcd_url: str) -> AsyncIterator[EtcdClient]:
    """dynamod's etcd client on that etcd (a module may define its own `etcd`)."""
    async with EtcdClient(etcd_url) as client:
        yield client
