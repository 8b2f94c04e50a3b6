"""The steps of `resolve_stack`, one at a time, on raw tables made in memory: expand
instances -> assign ports -> render -> link dependencies -> order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.core import limits
from dynamod.core.errors import CycleError, SpecError, SpecErrors
from dynamod.core.spec import links, nodes
from dynamod.core.spec.files import RawStack, RawUnit
from dynamod.core.spec.models import Condition, UnitSpec
from dynamod.core.spec.render import Renderer
from dynamod.core.spec.resolve import (
    Expanded,
    Instance,
    PortSource,
    assign_ports,
    base_context,
    expand_instances,
    render_unit,
    start_order,
    units_context,
    validate_unit,
)

SOURCE = Path("/stacks/s.toml")


def raw_stack(units: dict[str, dict[str, Any]], **vars: Any) -> RawStack:
    stack = RawStack(path=SOURCE, name="s", vars=dict(vars))
    stack.units = {n: RawUnit(n, SOURCE, t) for n, t in units.items()}
    return stack


def expand(
    stack: RawStack, extra: dict[str, int] | None = None
) -> tuple[Expanded, list[SpecError]]:
    errors: list[SpecError] = []
    where = nodes.placements(stack, None)
    context = {"vars": stack.vars}
    return expand_instances(stack, where, context, Renderer(), extra or {}, errors), errors


def counter(start: int = 40000) -> Iterator[int]:
    n = start
    while True:
        yield n
        n += 1


def test_expand_names_replicas_and_keeps_plain_units_whole() -> None:
    units = {"etcd": {}, "worker": {"replicas": "{vars.n}"}, "none": {"replicas": 0}}
    stack = raw_stack(units, n=3)
    expanded, errors = expand(stack)
    assert errors == []
    assert list(expanded.instances) == ["etcd", "worker@0", "worker@1", "worker@2"]
    assert expanded.replicated == {"worker": ["worker@0", "worker@1", "worker@2"], "none": []}
    assert expanded.instances["worker@2"].index == 2 and expanded.instances["etcd"].index is None


def test_expand_adds_extra_instances_to_replicas() -> None:
    expanded, _ = expand(raw_stack({"worker": {"replicas": 2}}), extra={"worker": 1})
    assert expanded.replicated["worker"] == ["worker@0", "worker@1", "worker@2"]


def test_expand_collects_one_error_per_unit_and_goes_on() -> None:
    stack = raw_stack({"a": {"replicas": "two"}, "b": {"replicas": limits.MAX_INSTANCES + 1},
                       "c": {}})
    expanded, errors = expand(stack)
    assert [(e.unit, e.field) for e in errors] == [("a", "replicas"), ("b", "replicas")]
    assert list(expanded.instances) == ["c"]


def test_expand_refuses_more_instances_than_the_bound_in_all() -> None:
    half = limits.MAX_INSTANCES // 2 + 1
    _, errors = expand(raw_stack({"a": {"replicas": half}, "b": {"replicas": half}}))
    assert len(errors) == 1 and errors[0].unit == "b" and "more than" in errors[0].message


def ports_of(stack: RawStack, pinned: dict[str, dict[str, int]] | None = None,
             ) -> tuple[dict[str, dict[str, int]], list[SpecError]]:
    expanded, errors = expand(stack)
    assert errors == []
    given = counter()
    source = PortSource(lambda: next(given), pinned)
    ports = assign_ports(expanded, {"vars": stack.vars}, Renderer(), source, errors)
    return ports, errors


def test_ports_fixed_base_plus_index_allocated_and_pinned() -> None:
    stack = raw_stack({
        "w": {"replicas": 2, "ports": {"http": 8000, "sys": 0, "t": "{vars.p}"}},
    }, p=9000)
    ports, errors = ports_of(stack, pinned={"w@1": {"sys": 7}})
    assert errors == []
    # a literal base port is offset by the index; a rendered one is taken as written
    assert ports == {"w@0": {"http": 8000, "sys": 40000, "t": 9000},
                     "w@1": {"http": 8001, "sys": 7, "t": 9000}}


def test_ports_errors_name_the_unit_and_field() -> None:
    stack = raw_stack({
        "a": {"ports": ["x"]},
        "b": {"ports": {"http": "nope"}},
        "c": {"replicas": 2, "ports": {"http": limits.MAX_PORT}},
    })
    _, errors = ports_of(stack)
    assert [(e.unit, e.field) for e in errors] == [
        ("a", "ports"), ("b", "ports.http"), ("c@1", "ports.http")]


def test_a_failing_allocator_is_a_spec_error() -> None:
    expanded, errors = expand(raw_stack({"a": {"ports": {"p": 0}}}))

    def refuse() -> int:
        raise OSError("no ports left")

    assign_ports(expanded, {}, Renderer(), PortSource(refuse), errors)
    assert len(errors) == 1 and "no ports left" in errors[0].message


def test_units_context_lists_ports_and_replicas() -> None:
    stack = raw_stack({"w": {"replicas": 2, "ports": {"h": 0}}})
    expanded, _ = expand(stack)
    context = units_context(expanded, {"w@0": {"h": 1}, "w@1": {"h": 2}})
    assert context == {"w@0": {"ports": {"h": 1}, "host": "127.0.0.1"},
                       "w@1": {"ports": {"h": 2}, "host": "127.0.0.1"},
                       "w": {"instances": ["w@0", "w@1"]}}


def test_render_fills_templates_and_keeps_resolver_keys_out() -> None:
    raw = RawUnit("w", SOURCE, {"command": ["serve", "--port", "{ports.http}", "{index}",
                                            "{units.db.ports.p}"],
                                "replicas": 2, "depends_on": ["db"], "ports": {"http": 0}})
    instance = Instance("w@1", raw, 1)
    context = {"vars": {}, "units": {"db": {"ports": {"p": 5}}}}
    rendered, deps = render_unit(instance, {"http": 8001}, context, None, Renderer())
    assert rendered == {"command": ["serve", "--port", "8001", "1", "5"]}
    assert deps == {"db": Condition.READY}


def test_render_refuses_the_remote_key_and_names_a_bad_template() -> None:
    with pytest.raises(SpecError) as caught:
        render_unit(Instance("a", RawUnit("a", SOURCE, {"remote": "n2", "command": ["x"]})),
                    {}, {}, None, Renderer())
    assert caught.value.field == "remote"
    with pytest.raises(SpecError) as caught:
        render_unit(Instance("a", RawUnit("a", SOURCE, {"command": ["{vars.nope}"]})),
                    {}, {"vars": {}}, None, Renderer())
    assert caught.value.field == "command[0]" and caught.value.unit == "a"


def test_link_expands_replicated_units_and_refuses_unknown_and_self() -> None:
    raw = RawUnit("f", SOURCE, {})
    deps = {"w": Condition.READY, "db": Condition.STARTED, "ghost": Condition.READY,
            "f": Condition.READY}
    instances = {"f", "db", "w@0", "w@1"}
    linked, errors = links.link("f", raw, deps, instances, {"w": ["w@0", "w@1"]}, ["db", "f", "w"])
    assert linked == {"w@0": Condition.READY, "w@1": Condition.READY, "db": Condition.STARTED}
    assert [e.field for e in errors] == ["depends_on.ghost", "depends_on.f"]
    assert "units in this stack: db, f, w" in errors[0].message


def test_dependencies_read_a_list_or_a_table() -> None:
    assert links.dependencies(RawUnit("a", SOURCE, {"depends_on": ["b"]})) == {"b": Condition.READY}
    table = {"depends_on": {"b": "completed"}}
    assert links.dependencies(RawUnit("a", SOURCE, table)) == {"b": Condition.COMPLETED}
    with pytest.raises(SpecError, match="unknown condition"):
        links.dependencies(RawUnit("a", SOURCE, {"depends_on": {"b": "soon"}}))


def spec(name: str, deps: dict[str, Condition] | None = None, **fields: Any) -> UnitSpec:
    return validate_unit(Instance(name, RawUnit(name, SOURCE, {})), {"command": ["x"], **fields},
                         {}, deps or {})


def test_validate_takes_what_the_resolver_decided() -> None:
    unit = spec("w", {"db": Condition.READY})
    assert (unit.name, unit.unit, unit.source, unit.depends_on) == (
        "w", "w", str(SOURCE), {"db": Condition.READY})


def test_order_puts_dependencies_first_and_names_a_cycle() -> None:
    specs = {"a": spec("a", {"b": Condition.READY}), "b": spec("b")}
    assert start_order(specs) == ["b", "a"]
    looped = {"a": spec("a", {"b": Condition.READY}), "b": spec("b", {"a": Condition.READY})}
    with pytest.raises(SpecErrors) as caught:
        start_order(looped)
    assert isinstance(caught.value.errors[0], CycleError)


def test_completed_dependency_on_an_always_restarted_unit_is_refused() -> None:
    specs = {"a": spec("a", {"b": Condition.COMPLETED}),
             "b": spec("b", restart={"policy": "always"})}
    (err,) = links.check_completed(specs)
    assert err.field == "depends_on.b" and "never completes" in err.message


def test_base_context_renders_vars_once() -> None:
    stack = raw_stack({}, name="m", model_dir="{state_dir}/{vars.name}")
    context = base_context(stack, Path("/state"), "/py", None, Renderer())
    assert context["vars"] == {"name": "m", "model_dir": "/state/m"}
    assert context["python"] == "/py" and context["stack_dir"] == "/stacks"
