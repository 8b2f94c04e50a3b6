"""Prometheus metrics (opt-in: `dynamod up --metrics-addr HOST:PORT`).

Gauges and counters are read from the engine at scrape time (a custom collector), so
they can never drift from what `dynamod status` shows. What only exists as an event is
recorded as it happens: probe latency (engine probe listener) and recovery time (state
listener). The registry is dedicated (no process/platform collectors of the default one)
and is served by aiohttp on the daemon's own event loop, so scrapes read engine state
from the loop's thread.

  dynamod_stack_phase{stack,phase}              1 for the daemon's current phase
  dynamod_stack_degraded_unit{stack,unit,state,reason}   1 per unit keeping it degraded
  dynamod_unit_state{unit,state}                1 for the unit's current state, else 0
  dynamod_unit_restarts_total{unit}             restarts decided by the restart policy
  dynamod_unit_oom_kills_total{unit}            exits by the kernel's OOM killer
  dynamod_unit_last_recovery_seconds{unit}      last failure/exit -> ready again
  dynamod_probe_duration_seconds{unit,probe,result}   readiness/liveness probe latency
  dynamod_shards_held                           rollout shards held out of routing
  dynamod_shards_paused_outside                 rollout shards a process outside dynamod
                                                claimed paused (verl; rollout/pause_claims.py)
  dynamod_shard_policy_version_lag{unit}        ledger version - shard's applied version
  dynamod_spares_available                      hot spares ready to be promoted
  dynamod_spares_asleep                         hot spares sleeping (control/sleep)
  dynamod_spare_promotions_total{reason}        spares taken into service (exit, verification,
                                                lost, apply)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynamod.core.errors import DynamodError
from dynamod.core.extensions import Extension
from dynamod.core.phase import Phase
from dynamod.core.state import UnitState
from dynamod.core.status import ExtensionUnitStatus
from dynamod.ops.httpsite import Site

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from dynamod.core.engine import Unit
    from dynamod.core.extensions import ExtensionHost
    from dynamod.core.probes import ProbeResult

log = structlog.get_logger("dynamod.ops.metrics")

_DOWN = {UnitState.BACKOFF, UnitState.WAITING, UnitState.FAILED, UnitState.DEGRADED}
_PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `:PORT` (loopback). Raises DynamodError otherwise."""
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not sep or not 0 <= port <= 65535:
        raise DynamodError(
            f"--metrics-addr expects HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}"
        )
    return host, port


def policy_lag(status: ExtensionUnitStatus) -> int:
    """How many policy versions a shard is behind; 0 when it reports none."""
    policy = status.get("policy")
    if policy is None:
        return 0
    version, current = policy.get("version"), policy["current"]
    if version is None or current is None:
        return 0
    return max(current - version, 0)


def is_shard(unit: Unit, status: ExtensionUnitStatus) -> bool:
    """A rollout shard: a Dynamo worker, or anything the policy ledger tracks."""
    return "dynamo" in unit.spec.tables or "policy" in status


class RecoveryClock:
    """Time from a unit going down (backoff, failed, degraded) to ready again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.down_since: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def on_transition(self, unit: Unit, old: UnitState, new: UnitState) -> None:
        if new in _DOWN:
            self.down_since.setdefault(unit.name, self.clock())
        elif new is UnitState.READY and unit.name in self.down_since:
            self.last[unit.name] = self.clock() - self.down_since.pop(unit.name)
        elif new in {UnitState.STOPPING, UnitState.STOPPED}:
            self.down_since.pop(unit.name, None)  # stopped on purpose: nothing to recover


class StackCollector(Collector):
    """Reads the daemon and its engine at scrape time."""

    def __init__(self, host: ExtensionHost, recovery: RecoveryClock) -> None:
        self.host = host
        self.recovery = recovery

    def collect(self) -> Iterator[Metric]:
        units = list(self.host.engine.units.values()) if self.host.engine else []
        yield from self._stack_families()
        yield from self._unit_families(units)
        yield from self._shard_families(units)

    def _stack_families(self) -> Iterator[Metric]:
        """The stack's phase, and the units that keep it degraded."""
        host = self.host
        phase = GaugeMetricFamily(
            "dynamod_stack_phase", "1 for the daemon's current phase", labels=["stack", "phase"]
        )
        for each_phase in Phase:
            phase.add_metric(
                [host.stack.name, each_phase], 1.0 if host.phase is each_phase else 0.0
            )
        yield phase
        degraded = GaugeMetricFamily(
            "dynamod_stack_degraded_unit",
            "1 for each unit that keeps a stack that was up degraded, with its state and why",
            labels=["stack", "unit", "state", "reason"],
        )
        for name, why in host.degraded_units().items():
            state_name, _, reason = why.partition(": ")
            degraded.add_metric([host.stack.name, name, state_name, reason[:100]], 1.0)
        yield degraded

    def _unit_families(self, units: list[Unit]) -> Iterator[Metric]:
        """Every unit's state, restarts and last recovery time."""
        state = GaugeMetricFamily(
            "dynamod_unit_state",
            "1 for the unit's current state, 0 otherwise",
            labels=["unit", "state"],
        )
        restarts = CounterMetricFamily(
            "dynamod_unit_restarts",
            "Restarts decided by the unit's restart policy",
            labels=["unit"],
        )
        oom_kills = CounterMetricFamily(
            "dynamod_unit_oom_kills",
            "Exits of the unit by the kernel's OOM killer (its memory limit reached)",
            labels=["unit"],
        )
        recovery = GaugeMetricFamily(
            "dynamod_unit_last_recovery_seconds",
            "Seconds from the unit's last failure or exit until it was ready again",
            labels=["unit"],
        )
        for unit in units:
            for each_state in UnitState:
                state.add_metric([unit.name, each_state], 1.0 if unit.state is each_state else 0.0)
            restarts.add_metric([unit.name], unit.tracker.total)
            oom_kills.add_metric([unit.name], unit.oom_kills)
            if unit.name in self.recovery.last:
                recovery.add_metric([unit.name], self.recovery.last[unit.name])
        yield state
        yield restarts
        yield oom_kills
        yield recovery

    def _shard_families(self, units: list[Unit]) -> Iterator[Metric]:
        """The rollout shards: policy lag, held shards, hot spares and their promotions."""
        lag = GaugeMetricFamily(
            "dynamod_shard_policy_version_lag",
            "Policy versions a rollout shard is behind the ledger",
            labels=["unit"],
        )
        held = available = asleep = paused_outside = 0
        promotions: dict[str, int] = {}
        for unit in units:
            extended = self.host.extension_status(unit)  # the rollout layer's keys, as in status
            spare = extended.get("spare")
            if spare is not None and spare["role"] == "spare" and unit.state is UnitState.READY:
                available += 1
                asleep += spare["sleeping"]
            for reason, count in (spare["promotions"] if spare else {}).items():
                promotions[reason] = promotions.get(reason, 0) + count
            if is_shard(unit, extended):
                lag.add_metric([unit.name], policy_lag(extended))
                held += unit.hold_reason is not None
                paused_outside += bool(extended.get("policy", {}).get("paused_by"))
        yield lag
        yield GaugeMetricFamily(
            "dynamod_shards_held", "Rollout shards held out of routing (catching up)", value=held
        )
        yield GaugeMetricFamily(
            "dynamod_shards_paused_outside",
            "Rollout shards a process outside dynamod (verl) claimed paused",
            value=paused_outside,
        )
        yield GaugeMetricFamily(
            "dynamod_spares_available", "Hot spare shards ready to be promoted", value=available
        )
        yield GaugeMetricFamily(
            "dynamod_spares_asleep", "Hot spare shards sleeping (control/sleep)", value=asleep
        )
        promoted = CounterMetricFamily(
            "dynamod_spare_promotions",
            "Hot spares taken into service, by why the shard they replaced left",
            labels=["reason"],
        )
        for reason in ("exit", "verification", "lost", "apply"):
            promoted.add_metric([reason], promotions.get(reason, 0))
        yield promoted


class MetricsServer(Extension):
    """Daemon extension: serves /metrics on `address` for the daemon's lifetime.

    The address is bound when the server is made, before the daemon starts anything, so
    a taken port fails `dynamod up` at once instead of after the stack came up."""

    def __init__(self, address: str) -> None:
        host, port = parse_address(address)
        self.site = Site(host, port, what="metrics", option="--metrics-addr")
        self.url = f"{self.site.base_url}/metrics"
        self.registry = CollectorRegistry(auto_describe=True)
        self.recovery = RecoveryClock()
        self.probe_duration = Histogram(
            "dynamod_probe_duration_seconds",
            "Readiness (probe=ready) and liveness (probe=live) probe latency",
            ["unit", "probe", "result"],
            buckets=_PROBE_BUCKETS,
            registry=self.registry,
        )

    def on_probe(self, unit: Unit, probe: str, result: ProbeResult) -> None:
        outcome = "ok" if result.ok else "fail"
        self.probe_duration.labels(unit.name, probe, outcome).observe(result.latency)

    async def start(self, host: ExtensionHost) -> None:
        assert host.engine is not None
        self.registry.register(StackCollector(host, self.recovery))
        host.engine.listeners.append(self.recovery.on_transition)
        host.engine.probe_listeners.append(self.on_probe)
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        await self.site.start(app)
        log.info("metrics.serving", url=self.url)

    async def stop(self) -> None:
        await self.site.stop()

    async def _handle(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
