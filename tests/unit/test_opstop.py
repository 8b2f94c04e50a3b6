"""`stop UNIT` / `start UNIT`: which units a name means and what each action does."""

from __future__ import annotations

import pytest

from dynamod.core import opstop
from dynamod.core.errors import UnknownUnit
from dynamod.core.state import UnitState

BASES = {"etcd": "etcd", "frontend": "frontend", "worker@0": "worker", "worker@1": "worker"}


def test_a_replica_a_unit_and_a_base_name() -> None:
    assert opstop.select("worker@1", BASES) == ["worker@1"]
    assert opstop.select("frontend", BASES) == ["frontend"]
    assert opstop.select("worker", BASES) == ["worker@0", "worker@1"]


def test_an_unknown_name_is_refused_with_the_closest_names() -> None:
    with pytest.raises(UnknownUnit) as caught:
        opstop.select("wrker", BASES)
    message = str(caught.value)
    assert "'wrker'" in message and "did you mean worker" in message
    assert "\n" not in message
    with pytest.raises(UnknownUnit, match="units: etcd, frontend, worker"):
        opstop.select("zzz", BASES)


def _view(name: str, state: UnitState, held: bool = False) -> opstop.UnitView:
    return opstop.UnitView(name, state, held)


def test_stop_leaves_a_held_unit_and_stops_any_other() -> None:
    plan = opstop.plan(
        "stop",
        [_view("a", UnitState.READY), _view("b", UnitState.STOPPED, held=True),
         _view("c", UnitState.BACKOFF)],
    )
    assert plan.act == ["a", "c"]
    assert plan.already == {"b": "already stopped by `dynamod stop`"}


def test_start_starts_only_held_units() -> None:
    plan = opstop.plan(
        "start",
        [_view("a", UnitState.READY), _view("b", UnitState.STOPPED, held=True),
         _view("c", UnitState.FAILED)],
    )
    assert plan.act == ["b"]
    assert plan.already["a"] == "already running (ready)"
    assert "is failed, not stopped by `dynamod stop`" in plan.already["c"]
