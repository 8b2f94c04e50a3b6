"""dynamod.ops.metrics pure parts: address parsing, recovery timing, policy lag."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dynamod.core.errors import DynamodError
from dynamod.core.state import UnitState as S
from dynamod.core.status import ExtensionUnitStatus
from dynamod.ops.metrics import RecoveryClock, is_shard, parse_address, policy_lag


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        (":9464", ("127.0.0.1", 9464)),
        ("[::1]:9464", ("::1", 9464)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_parse_address(address: str, parsed: tuple[str, int]) -> None:
    assert parse_address(address) == parsed


@pytest.mark.parametrize("address", ["9464", "localhost", "host:port", "127.0.0.1:70000"])
def test_parse_address_rejects(address: str) -> None:
    with pytest.raises(DynamodError, match="--metrics-addr expects HOST:PORT"):
        parse_address(address)


def unit(name: str = "worker@0") -> Any:
    return SimpleNamespace(name=name, spec=SimpleNamespace(tables={}))


def policy(version: int | None, current: int | None) -> ExtensionUnitStatus:
    return {"policy": {"version": version, "current": current, "admitted": True, "digest": None,
                       "last_ack_ms": {}, "last_error": None, "routed_version": None}}  # fmt: skip


def test_recovery_is_measured_from_first_failure_to_ready() -> None:
    now = [100.0]
    clock = RecoveryClock(lambda: now[0])
    worker = unit()
    for old, new, at in [
        (S.STARTING, S.READY, 100.0),
        (S.READY, S.BACKOFF, 101.0),  # died
        (S.BACKOFF, S.STARTING, 101.5),
        (S.STARTING, S.BACKOFF, 102.0),  # died again before ready: same outage
        (S.BACKOFF, S.STARTING, 103.0),
        (S.STARTING, S.HELD, 103.5),  # up, catching up with the policy
        (S.HELD, S.READY, 104.5),
    ]:
        now[0] = at
        clock.on_transition(worker, old, new)
    assert clock.last == {"worker@0": 3.5}
    assert clock.down_since == {}


def test_a_deliberate_stop_is_not_an_outage() -> None:
    now = [0.0]
    clock = RecoveryClock(lambda: now[0])
    worker = unit()
    clock.on_transition(worker, S.READY, S.DEGRADED)
    clock.on_transition(worker, S.DEGRADED, S.STOPPING)
    now[0] = 50.0
    clock.on_transition(worker, S.STOPPED, S.STARTING)
    clock.on_transition(worker, S.STARTING, S.READY)
    assert clock.last == {}


def test_policy_lag_and_shards() -> None:
    assert policy_lag(policy(9, 12)) == 3
    assert policy_lag(policy(12, 12)) == 0
    assert policy_lag(policy(None, 12)) == 0
    assert policy_lag({}) == 0
    assert is_shard(unit(), policy(1, 1))
    assert not is_shard(unit("etcd"), {})


def test_spare_gauges_and_promotions_read_from_the_units() -> None:
    from dynamod.core.phase import Phase
    from dynamod.ops.metrics import StackCollector

    spares: dict[str, ExtensionUnitStatus] = {}

    def shard(name: str, state: S, role: str, promotions: dict[str, int], **more: Any) -> Any:
        spares[name] = {"spare": {"role": role, "sleeping": False, "promotions": promotions,
                                  **more}}  # fmt: skip
        return SimpleNamespace(
            name=name,
            state=state,
            spec=SimpleNamespace(tables={"dynamo": object()}),
            tracker=SimpleNamespace(total=0),
            hold_reason=None,
            oom_kills=2 if name == "worker@3" else 0,
        )

    units = [
        shard("worker@0", S.READY, role="serving", promotions={"exit": 2}),
        shard("worker@1", S.READY, role="spare", sleeping=True, promotions={"verification": 1}),
        shard("worker@2", S.HELD, role="spare", sleeping=False, promotions={}),  # catching up
        shard("worker@3", S.READY, role="spare", sleeping=False, promotions={"exit": 1}),
    ]
    daemon = SimpleNamespace(
        stack=SimpleNamespace(name="s"),
        phase=Phase.UP,
        engine=SimpleNamespace(units={u.name: u for u in units}),
        degraded_units=dict,  # nothing degraded
        extension_status=lambda unit: spares[unit.name],
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in StackCollector(daemon, RecoveryClock()).collect()  # type: ignore[arg-type]
        for s in family.samples
    }
    assert samples[("dynamod_spares_available", ())] == 2
    assert samples[("dynamod_spares_asleep", ())] == 1
    assert samples[("dynamod_spare_promotions_total", (("reason", "exit"),))] == 3
    assert samples[("dynamod_spare_promotions_total", (("reason", "verification"),))] == 1
    assert samples[("dynamod_spare_promotions_total", (("reason", "lost"),))] == 0
    assert samples[("dynamod_unit_oom_kills_total", (("unit", "worker@3"),))] == 2
    assert samples[("dynamod_unit_oom_kills_total", (("unit", "worker@0"),))] == 0
