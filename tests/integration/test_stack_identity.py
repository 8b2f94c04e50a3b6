"""Two stacks on one etcd are kept apart (issue 25, item 2): one infra stack (etcd and NATS,
the stock `infra`) and two copies of the stock `local` stack on it (`--var etcd=… --var
nats=…`, one CPU worker each, no trainer), told apart by their identity (`--var
stack_id=alpha` / `beta`), from which their ledger keys and Dynamo namespace derive.

- every answer through a stack's frontend comes from that stack's own worker, round after
  round (CI: 2 rounds; `make soak-stack-identity` runs the issue's 20);
- a push to alpha moves alpha's ledger and never beta's;
- `up` of a second alpha while alpha runs is refused (exit 2, naming alpha's daemon, nothing
  started), and so is a third stack on alpha's Dynamo namespace;
- beta started again (its start-up sweep runs while alpha serves) revokes none of alpha's
  live registrations."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dynamod.rollout import dynamo
from dynamod.rollout.etcd import EtcdClient
from tests.conftest import Dynamod, unit_by_name
from tests.integration.policystack import model_dir, push, served_by

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("DYNAMOD_STACK_IDENTITY_ROUNDS", "2"))
PER_ROUND = 4  # requests through each frontend per round


def _new_dm() -> Dynamod:
    return Dynamod(Path(tempfile.mkdtemp(prefix="dm-id-", dir="/tmp")))


def _down(dm: Dynamod) -> None:
    if (dm.state_dir / "dynamod.sock").exists():
        dm.run("down", timeout=120)


@pytest.fixture(scope="module")
def infra() -> Iterator[tuple[Dynamod, str, str]]:
    """The infra stack: (its dynamod, etcd HOST:PORT, NATS HOST:PORT)."""
    dm = _new_dm()
    try:
        dm.run("up", "infra", "--detach", timeout=120, check=True)
        status = dm.status()
        etcd = f"127.0.0.1:{unit_by_name(status, 'etcd')['ports']['client']}"
        nats = f"127.0.0.1:{unit_by_name(status, 'nats')['ports']['client']}"
        yield dm, etcd, nats
    finally:
        _down(dm)
        shutil.rmtree(dm.state_dir, ignore_errors=True)


def _args(infra: tuple[Dynamod, str, str], stack_id: str, *extra: str) -> list[str]:
    _, etcd, nats = infra
    return ["up", "local", "--detach", "--var", f"etcd={etcd}", "--var", f"nats={nats}",
            "--var", f"stack_id={stack_id}", "--var", "workers=1", "--var", "trainer_steps=0",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def stacks(infra: tuple[Dynamod, str, str]) -> Iterator[dict[str, Dynamod]]:
    """alpha and beta, started at once (each one's sweep runs while the other boots)."""
    dms = {"alpha": _new_dm(), "beta": _new_dm()}
    try:
        with ThreadPoolExecutor(2) as pool:
            ups = {k: pool.submit(dm.run, *_args(infra, k), timeout=240) for k, dm in dms.items()}
            for name, up in ups.items():
                result = up.result()
                assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        yield dms
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(_down, dms.values()))
        for dm in dms.values():
            shutil.rmtree(dm.state_dir, ignore_errors=True)


def _instances(status: dict[str, Any]) -> set[int]:
    return {i for u in status["units"] if u.get("dynamo") for i in u["dynamo"]["instance_ids"]}


def _frontend(status: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{unit_by_name(status, 'frontend')['ports']['http']}"


async def _etcd_view(etcd: str) -> tuple[set[str], dict[str, set[int]]]:
    """The daemon keys, and each namespace's registered instance ids."""
    async with EtcdClient(f"http://{etcd}") as client:
        daemons = {kv.key for kv in await client.get_prefix("dynamod/") if
                   kv.key.endswith("/daemon")}  # fmt: skip
        spaces = {ns: {i.instance_id for i in await dynamo.list_instances(client, ns)}
                  for ns in ("alpha", "beta")}  # fmt: skip
    return daemons, spaces


def test_each_frontend_serves_only_its_own_stacks_workers(
    infra: tuple[Dynamod, str, str], stacks: dict[str, Dynamod]
) -> None:
    status = {name: dm.status() for name, dm in stacks.items()}
    mine = {name: _instances(s) for name, s in status.items()}
    assert all(len(ids) == 1 for ids in mine.values()), mine
    assert not mine["alpha"] & mine["beta"]
    for name, s in status.items():
        worker = unit_by_name(s, "worker@0")
        assert worker["dynamo"]["namespace"] == name  # the namespace is the identity
        assert unit_by_name(s, "etcd")["pid"] is None  # the infra stack's, not started here
        assert s["identity"]["held"] and s["identity"]["shared_namespaces"] == {}
    daemons, spaces = asyncio.run(_etcd_view(infra[1]))
    assert daemons == {"dynamod/alpha/daemon", "dynamod/beta/daemon"}
    assert spaces == mine
    for round_ in range(ROUNDS):
        for name, s in status.items():
            served = asyncio.run(served_by(_frontend(s), PER_ROUND))
            assert set(served) <= mine[name], f"round {round_}: {name} served by {served}"
    after = {name: dm.status() for name, dm in stacks.items()}
    for name in stacks:  # no worker was restarted meanwhile (none revoked, none lost)
        assert unit_by_name(after[name], "worker@0")["restarts"] == 0
        assert _instances(after[name]) == mine[name]


def test_a_push_to_one_stack_never_changes_the_others_versions(
    infra: tuple[Dynamod, str, str], stacks: dict[str, Dynamod], tmp_path: Path
) -> None:
    alpha, beta = stacks["alpha"], stacks["beta"]
    before = beta.status()["policy"]["current"]
    step = tmp_path / "alpha-1"  # the tiny model's own weights, as a new version (no torch)
    shutil.copytree(model_dir(alpha.status()), step)
    pushed = push(alpha, 1, step)
    assert pushed["ok"] and set(pushed["acks"]) == {"worker@0"}, pushed
    assert alpha.status()["policy"]["current"] == 1
    assert beta.status()["policy"]["current"] == before != 1

    async def ledgers() -> dict[str, Any]:
        async with EtcdClient(f"http://{infra[1]}") as client:
            return {n: await client.get(f"dynamod/{n}/policy/current") for n in stacks}

    current = asyncio.run(ledgers())
    assert current["alpha"] is not None and json.loads(current["alpha"])["version"] == 1
    assert current["beta"] is None or json.loads(current["beta"])["version"] == before
    ledger = json.loads(beta.run("policy", "status", "--json", check=True).stdout)
    assert ledger["current"] == before
    assert all(shard["policy_version"] == before for shard in ledger["shards"])


def test_a_second_copy_of_a_running_stack_is_refused_and_starts_nothing(
    infra: tuple[Dynamod, str, str], stacks: dict[str, Dynamod]
) -> None:
    alpha = stacks["alpha"]
    worker_before = unit_by_name(alpha.status(), "worker@0")
    cases = {  # the same identity; another identity on alpha's Dynamo namespace
        "stack identity 'alpha' is held by a live daemon": _args(infra, "alpha"),
        "Dynamo namespace 'alpha' is used by the workers of": _args(
            infra, "gamma", "--var", "namespace=alpha"),
    }  # fmt: skip
    copies = {expect: _new_dm() for expect in cases}
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = {e: pool.submit(copies[e].run, *args, timeout=60) for e, args in cases.items()}
        for expect, run in runs.items():
            result, copy = run.result(), copies[expect]
            assert result.returncode == 2, result.stdout + result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and expect in lines[0], result.stderr
            assert f"state dir {alpha.state_dir}" in lines[0] and "nothing was started" in lines[0]
            assert not (copy.state_dir / "dynamod.sock").exists()
            assert not (copy.state_dir / "daemon.log").exists()
    finally:
        for copy in copies.values():
            shutil.rmtree(copy.state_dir, ignore_errors=True)
    # alpha's worker kept serving under the same process (its frontend's 0.5 s liveness
    # probe may restart it on a loaded machine: not the refused `up`'s doing)
    worker = unit_by_name(alpha.status(), "worker@0")
    assert (worker["pid"], worker["state"]) == (worker_before["pid"], "ready")


def test_a_restarted_stacks_sweep_revokes_none_of_the_others_live_instances(
    infra: tuple[Dynamod, str, str], stacks: dict[str, Dynamod]
) -> None:
    alpha, beta = stacks["alpha"], stacks["beta"]
    alpha_ids = _instances(alpha.status())
    old_beta = _instances(beta.status())
    beta.run("down", timeout=120, check=True)
    beta.run(*_args(infra, "beta"), timeout=240, check=True)  # its sweep runs at this start
    new_beta = _instances(beta.status())
    assert new_beta and not new_beta & old_beta
    _, spaces = asyncio.run(_etcd_view(infra[1]))
    assert spaces == {"alpha": alpha_ids, "beta": new_beta}
    worker = unit_by_name(alpha.status(), "worker@0")
    assert worker["restarts"] == 0 and worker["state"] == "ready"
    served = asyncio.run(served_by(_frontend(alpha.status()), 2))
    assert set(served) <= alpha_ids
