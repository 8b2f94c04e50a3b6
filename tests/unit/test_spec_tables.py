"""The core's table registry: a layer above the core adds unit tables, stack tables and
probe kinds to the stack format; the core validates them without knowing what they mean.
Tables made here stand in for the rollout layer's; the registries are restored after."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import Field

from dynamod.core import spec
from dynamod.core.errors import SpecError, SpecErrors
from dynamod.core.spec import files, models, tables


class Lamp(spec.SpecModel):
    colour: Literal["red", "green"]
    watts: int = Field(10, ge=1)


class Show(spec.SpecModel):
    units: list[str]
    encore: int = 0


class WaveProbe(spec.ProbeBase):
    kind: Literal["wave"]
    hands: int


def _encore(table: Mapping[str, Any], raw: spec.RawStack, render: tables.Render) -> dict[str, int]:
    return {str(table["units"][0]): int(render(table.get("encore", 0), "show.encore"))}


def _check(show: Show, specs: Mapping[str, spec.UnitSpec], path: Path) -> list[SpecError]:
    bases = {s.unit for s in specs.values()}
    return [SpecError(f"no unit {u!r}", file=path, field="show.units")
            for u in show.units if u not in bases]


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables, "_UNIT_TABLES", dict(tables._UNIT_TABLES))
    monkeypatch.setattr(tables, "_STACK_TABLES", dict(tables._STACK_TABLES))
    monkeypatch.setattr(files, "_REGISTERED", list(files._REGISTERED))
    monkeypatch.setattr(models, "_EXTRA_PROBES", dict(models._EXTRA_PROBES))
    spec.register_unit_table(spec.UnitTable("lamp", Lamp))
    spec.register_stack_table(spec.StackTable("show", Show, extra_replicas=_encore, check=_check))
    spec.register_probe("wave", WaveProbe)


def load(tmp_path: Path, text: str) -> spec.Stack:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    counter = itertools.count(30000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter))


def errors_of(tmp_path: Path, text: str) -> list[SpecError]:
    with pytest.raises(SpecErrors) as caught:
        load(tmp_path, text)
    return caught.value.errors


def test_registered_tables_and_probe_resolve(tmp_path: Path) -> None:
    stack = load(tmp_path, """
        [show]
        units = ["dancer"]
        encore = "{vars.n}"
        [vars]
        n = 1
        [units.dancer]
        command = ["dance"]
        replicas = 2
        lamp = { colour = "red" }
        ready = { kind = "wave", hands = 2 }
    """)
    dancers = [stack.units[n] for n in stack.order]
    assert [d.name for d in dancers] == ["dancer@0", "dancer@1", "dancer@2"]
    assert all(d.tables == {"lamp": Lamp(colour="red")} for d in dancers)
    assert isinstance(dancers[0].ready, WaveProbe) and dancers[0].ready.hands == 2
    assert stack.tables == {"show": Show(units=["dancer"], encore=1)}


def test_unit_table_errors_name_the_field_as_written(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        lamp = { colour = "blue", watts = 0, plug = "eu" }
    """)
    assert sorted(e.field or "" for e in errs) == ["lamp.colour", "lamp.plug", "lamp.watts"]
    assert all(e.unit == "a" for e in errs)


def test_stack_table_errors_and_checks(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [show]
        units = "dancer"
        [units.a]
        command = ["a"]
    """)
    assert err.field == "show.units" and err.unit is None
    (err,) = errors_of(tmp_path, """
        [show]
        units = ["ghost"]
        [units.ghost2]
        command = ["a"]
    """)
    assert err.field == "show.units" and "no unit 'ghost'" in err.message


def test_only_the_stack_file_may_have_a_stack_table(tmp_path: Path) -> None:
    (tmp_path / "inc.toml").write_text('[show]\nunits = ["a"]\n')
    with pytest.raises(SpecError) as caught:  # read errors stop at the first
        load(tmp_path, '[stack]\ninclude = ["inc.toml"]\n[units.a]\ncommand = ["a"]\n')
    err = caught.value
    assert err.field == "show" and "only the stack file itself" in err.message


def test_an_unregistered_table_is_an_unknown_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 ) -> None:
    monkeypatch.setattr(tables, "_UNIT_TABLES", {})
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        lamp = { colour = "red" }
    """)
    assert (err.field, err.message) == ("lamp", "unknown key")


def test_a_file_cannot_set_the_resolvers_tables(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        tables = { lamp = { colour = "red" } }
    """)
    assert (err.field, err.message) == ("tables", "unknown key")


def test_unknown_probe_kind_lists_the_registered_ones(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        ready = { kind = "telepathy" }
    """)
    assert err.field == "ready" and "'telepathy'" in err.message and "wave" in err.message


def test_taken_names_are_refused() -> None:
    with pytest.raises(ValueError, match="already taken"):
        spec.register_unit_table(spec.UnitTable("command", Lamp))
    with pytest.raises(ValueError, match="already taken"):
        spec.register_unit_table(spec.UnitTable("lamp", Show))
    with pytest.raises(ValueError, match="already taken"):
        spec.register_probe("tcp", WaveProbe)
    with pytest.raises(ValueError, match="core's"):
        spec.register_stack_table(spec.StackTable("cluster", Show))
    spec.register_unit_table(spec.UnitTable("lamp", Lamp))  # the same again: idempotent
