"""`dynamod down --cluster`: stop every node in reverse dependency order across nodes.

The daemon asked (any node) writes a stop request in the registry, one step per stop tier
of the cluster-wide unit graph (e.g. trainer; frontend; the workers of every node); each
node's daemon, polling the registry, stops its own instances of that tier's units and
acks. Then the nodes exit, the ones that do not run the head's infrastructure first, the
head after them and the asking node last, each stopping what is left (etcd and NATS on the
head). A node that does not ack within the wait is reported and left out of later steps,
never waited on again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from dynamod.cluster import registry
from dynamod.cluster.registry import ForgottenRecord, LostRecord, NodeEntry

if TYPE_CHECKING:
    from dynamod.core.engine import Engine
    from dynamod.core.placement import ClusterSpec
    from dynamod.rollout.etcd import EtcdClient

log = structlog.get_logger("dynamod.cluster.shutdown")

EXIT = "exit"
_POLL_S = 0.1
_EXIT_ACK_WAIT_S = 5.0


class RegistryView(Protocol):
    """The cluster registry as this node's membership last read it (cluster/membership.py),
    and the client to write to it: what a shutdown reads and writes."""

    @property
    def cluster(self) -> ClusterSpec: ...

    @property
    def stack(self) -> str: ...

    @property
    def etcd(self) -> EtcdClient | None: ...

    @property
    def entries(self) -> Mapping[str, NodeEntry]: ...

    @property
    def lost(self) -> Mapping[str, LostRecord]: ...

    @property
    def seen(self) -> set[str]: ...

    @property
    def forgotten(self) -> Mapping[str, ForgottenRecord]: ...

    @property
    def down_request(self) -> dict[str, Any] | None: ...

    @property
    def down_acks(self) -> Mapping[str, dict[str, Any]]: ...

    async def read(self) -> None:
        """Read the registry again (the properties above then show what it holds now)."""


class ClusterShutdown:
    def __init__(self, registry_view: RegistryView, *, wait_s: float) -> None:
        self.view = registry_view
        self.wait_s = wait_s
        self.id = uuid.uuid4().hex[:12]
        self.report: dict[str, dict[str, Any]] = {}

    async def run(self) -> dict[str, Any]:
        """Every step in order; returns node -> what it stopped (or why nothing)."""
        started = time.monotonic()
        cluster = self.view.cluster
        await self.view.read()
        live = [n for n in cluster.nodes if n in self.view.entries]
        for name in cluster.nodes:
            if name not in live:
                self.report[name] = {
                    "answered": False,
                    "stopped": [],
                    "why": f"no entry in the registry ({self._state(name)}): not asked",
                }
            else:
                self.report[name] = {"answered": True, "stopped": []}
        tiers = cluster.stop_tiers[:-1] if len(cluster.stop_tiers) > 1 else []
        for index, units in enumerate(tiers):
            await self._step(str(index), units, live)
        with contextlib.suppress(Exception):  # a clean stop leaves no lost record behind
            assert self.view.etcd is not None
            await self.view.etcd.delete_prefix(registry.prefix(self.view.stack) + "lost/")
            await self.view.etcd.delete_prefix(registry.prefix(self.view.stack) + "forgotten/")
        me = cluster.node
        first = [n for n in live if n not in {cluster.head, me}]
        await self._step(EXIT, [], first)
        if cluster.head != me and cluster.head in live:
            await self._step(EXIT, [], [cluster.head])
        self.report[me]["stopped"] += ["(this node: everything left, below)"]
        log.info("cluster.down", id=self.id, seconds=round(time.monotonic() - started, 3))
        return {
            "id": self.id,
            "ok": all(r["answered"] for n, r in self.report.items() if n in live),
            "seconds": round(time.monotonic() - started, 3),
            "tiers": [list(t) for t in cluster.stop_tiers],
            "nodes": self.report,
        }

    def _state(self, name: str) -> str:
        view = self.view
        return str(registry.node_state(name, view.entries, view.lost, view.seen, view.forgotten))

    async def _step(self, step: str, units: list[str], nodes: list[str]) -> None:
        asked = [n for n in nodes if self.report[n]["answered"]]
        if not asked:
            return
        assert self.view.etcd is not None
        request = {
            "id": self.id,
            "step": step,
            "units": units,
            "nodes": asked,
            "by": self.view.cluster.node,
        }
        await self.view.etcd.put(registry.down_key(self.view.stack), json.dumps(request))
        deadline = time.monotonic() + self.wait_s
        waiting = set(asked)
        while waiting and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
            with contextlib.suppress(Exception):
                await self.view.read()
            for name in list(waiting):
                ack = self.view.down_acks.get(name)
                if ack and ack.get("id") == self.id and ack.get("step") == step:
                    waiting.discard(name)
                    self.report[name]["stopped"] += list(ack.get("stopped", []))
        # An exiting node waits for this before it stops (the head's etcd holds the acks).
        seen = {
            "id": self.id,
            "step": f"{step}-seen",
            "units": [],
            "nodes": [],
            "by": request["by"],
        }
        with contextlib.suppress(Exception):
            await self.view.etcd.put(registry.down_key(self.view.stack), json.dumps(seen))
        for name in waiting:
            self.report[name]["answered"] = False
            self.report[name]["why"] = (
                f"no answer to step {step} ({', '.join(units) or 'exit'}) within {self.wait_s:g}s"
            )
            log.warning("cluster.down_no_answer", node=name, step=step)


async def carry_out(
    view: RegistryView,
    engine: Engine,
    down: Callable[[], Awaitable[object]],
    request: dict[str, Any],
) -> None:
    """This node's part of one step: stop its instances of the step's units and ack; or,
    for the exit step, ack and take the whole daemon down (`down`)."""
    assert view.etcd is not None
    step = str(request.get("step"))
    wanted = set(request.get("units", []))
    stopped: list[str] = []
    if step != EXIT:
        units = [
            u
            for u in engine.units.values()
            if u.spec.unit in wanted and u.spec.remote is None and u.state.value != "stopped"
        ]
        await asyncio.gather(*(engine.stop_unit(u) for u in units))
        stopped = [u.name for u in units]
    else:
        stopped = [
            u.name
            for u in engine.units.values()
            if u.spec.remote is None and u.state.value != "stopped"
        ]
    ack = {"id": request.get("id"), "step": step, "stopped": stopped}
    with contextlib.suppress(Exception):
        await view.etcd.put(registry.down_ack_key(view.stack, view.cluster.node), json.dumps(ack))
    log.info("cluster.down_step", step=step, stopped=stopped, by=request.get("by"))
    if step == EXIT:
        # Stopping may take the registry with it (the head's etcd): first let the asking
        # node see the ack, which it says by moving the request on.
        deadline = time.monotonic() + _EXIT_ACK_WAIT_S
        while time.monotonic() < deadline and view.down_request == request:
            await asyncio.sleep(_POLL_S)
        await down()
