"""A unit's `placement` (CPUs per replica) as the resolver applies it: replica i's CPU
list becomes its cpuset, unless `limits` names one, and the named environment variable."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamod.core.errors import SpecErrors
from dynamod.core.spec import Stack, load_stack, resolve_stack
from dynamod.core.spec.models import PlacementSpec
from dynamod.core.spec.quantities import parse_cpu_list


def resolved(tmp_path: Path, unit: str) -> Stack:
    path = tmp_path / "placed.toml"
    path.write_text("[units.shard]\ncommand = [\"sleep\", \"1\"]\n" + textwrap.dedent(unit))
    ports = itertools.count(32000)
    return resolve_stack(
        load_stack(path), state_dir=tmp_path, allocate_port=lambda *a, **k: next(ports)
    )


@given(st.integers(0, 64), st.integers(1, 16))
def test_replicas_get_disjoint_adjacent_cpus(index: int, n: int) -> None:
    cpus = PlacementSpec(cpus_per_replica=n).cpus(index)
    assert cpus is not None and parse_cpu_list(cpus) == set(range(index * n, index * n + n))


def test_no_cpus_no_placement() -> None:
    assert PlacementSpec().cpus(3) is None


def test_the_resolver_sets_cpuset_and_env(tmp_path: Path) -> None:
    stack = resolved(tmp_path, """
    replicas = 3
    placement = { cpus_per_replica = 2, cpus_env = "BIND" }
    env = { BIND = "nobind" }
    """)
    got = {n: (u.limits.cpuset if u.limits else None, u.env["BIND"])
           for n, u in stack.units.items()}  # fmt: skip
    assert got == {"shard@0": ("0-1", "0-1"), "shard@1": ("2-3", "2-3"),
                   "shard@2": ("4-5", "4-5")}  # fmt: skip


def test_a_units_own_cpuset_wins_and_zero_places_nothing(tmp_path: Path) -> None:
    own = resolved(tmp_path, """
    placement = { cpus_per_replica = 1, cpus_env = "BIND" }
    limits = { cpuset = "1", memory_max = "1G" }
    """).units["shard"]
    assert own.limits is not None and own.limits.cpuset == "1" and own.env["BIND"] == "1"
    none = resolved(tmp_path, 'placement = { cpus_per_replica = 0, cpus_env = "BIND" }\n')
    assert none.units["shard"].limits is None and "BIND" not in none.units["shard"].env


@pytest.mark.parametrize(("table", "field"), [
    ('placement = { cpus_per_replica = -1 }', "placement.cpus_per_replica"),
    ('placement = { cpus_per_replica = 1, cpus_env = "NOT A NAME" }', "placement.cpus_env"),
    ('placement = { cpus = 1 }', "placement.cpus"),
])
def test_a_bad_placement_names_its_field(tmp_path: Path, table: str, field: str) -> None:
    with pytest.raises(SpecErrors, match=f"unit 'shard', field '{field}'"):
        resolved(tmp_path, table + "\n")
