import itertools
import textwrap
from pathlib import Path

import pytest

from dynamod.core import spec
from dynamod.core.errors import CycleError, SpecError, SpecErrors
from dynamod.rollout.policy_table import policy_of, shards


def load(tmp_path: Path, text: str, **vars: object) -> spec.Stack:
    path = tmp_path / "stack.toml"
    path.write_text(textwrap.dedent(text))
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter),
                     var_overrides=vars)


def errors_of(tmp_path: Path, text: str) -> list[SpecError]:
    with pytest.raises(SpecErrors) as info:
        load(tmp_path, text)
    return info.value.errors


def test_replicas_ports_and_references(tmp_path: Path) -> None:
    stack = load(tmp_path, """
        [vars]
        workers = 2
        [units.etcd]
        command = ["etcd", "--port", "{ports.client}"]
        ports = { client = 0 }
        [units.worker]
        replicas = "{vars.workers}"
        command = ["w", "--etcd", "{units.etcd.ports.client}", "--gpu", "{index}"]
        ports = { system = 0, fixed = 9100 }
        env = { NAME = "{name}" }
        depends_on = ["etcd"]
        [units.frontend]
        command = ["fe", "{units.worker@1.ports.system}"]
        depends_on = { worker = "ready" }
    """)
    assert list(stack.units) == ["etcd", "worker@0", "worker@1", "frontend"]
    etcd_port = stack.units["etcd"].ports["client"]
    w0, w1 = stack.units["worker@0"], stack.units["worker@1"]
    assert w0.command == ["w", "--etcd", str(etcd_port), "--gpu", "0"]
    assert w1.command[-1] == "1" and w1.env["NAME"] == "worker@1"
    assert (w0.ports["fixed"], w1.ports["fixed"]) == (9100, 9101)
    assert w0.ports["system"] != w1.ports["system"]
    assert stack.units["frontend"].depends_on == {"worker@0": "ready", "worker@1": "ready"}
    assert stack.units["frontend"].command[1] == str(w1.ports["system"])
    assert stack.order.index("etcd") < stack.order.index("worker@0")


def test_var_override_changes_replicas(tmp_path: Path) -> None:
    text = """
        [vars]
        workers = 2
        [units.worker]
        replicas = "{vars.workers}"
        command = ["w"]
    """
    assert len(load(tmp_path, text, workers=4).units) == 4


def test_unknown_key_names_file_unit_and_field(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.etcd]
        command = ["etcd"]
        comand = ["typo"]
    """)
    assert err.unit == "etcd" and err.field == "comand" and err.message == "unknown key"
    assert err.file and err.file.endswith("stack.toml")
    assert "stack.toml" in str(err) and "'etcd'" in str(err) and "'comand'" in str(err)


def test_unknown_probe_key_and_bad_values(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        [units.a.ready]
        kind = "http"
        url = "http://x"
        expect_stauts = 200
        [units.a.stop]
        signal = "SIGNOPE"
        [units.a.restart]
        policy = "sometimes"
    """)
    fields = {e.field for e in errs}
    assert {"ready.expect_stauts", "stop.signal", "restart.policy"} <= fields
    assert all(e.unit == "a" for e in errs)


def test_unknown_probe_kind(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        ready = { kind = "telepathy" }
    """)
    assert err.field == "ready" and "telepathy" in err.message


def test_missing_command(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        description = "nothing to run"
    """)
    assert err.field == "command" and err.message == "required but missing"


def test_unknown_dependency(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        depends_on = ["etdc"]
    """)
    assert err.field == "depends_on.etdc" and "unknown unit 'etdc'" in err.message


def test_bad_condition(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        [units.b]
        command = ["b"]
        depends_on = { a = "healthy" }
    """)
    assert err.unit == "b" and err.field == "depends_on.a" and "healthy" in err.message


def test_cycle_is_refused_with_the_cycle(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        depends_on = ["c"]
        [units.b]
        command = ["b"]
        depends_on = ["a"]
        [units.c]
        command = ["c"]
        depends_on = ["b"]
    """)
    assert isinstance(err, CycleError)
    assert "a -> c -> b -> a" in str(err)


def test_unknown_template_reference(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a", "{ports.nope}"]
    """)
    assert err.field == "command[1]" and "{ports.nope}" in err.message


def test_completed_dependency_on_always_restarting_unit(tmp_path: Path) -> None:
    (err,) = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        restart = { policy = "always" }
        [units.b]
        command = ["b"]
        depends_on = { a = "completed" }
    """)
    assert "never completes" in err.message


def test_includes_and_duplicate_units(tmp_path: Path) -> None:
    (tmp_path / "etcd.toml").write_text('[units.etcd]\ncommand = ["etcd"]\n[vars]\nx = 1\n')
    stack = load(tmp_path, """
        [stack]
        name = "s"
        include = ["etcd.toml"]
        [vars]
        x = 2
        [units.a]
        command = ["a", "{vars.x}"]
    """)
    assert set(stack.units) == {"etcd", "a"} and stack.units["a"].command[1] == "2"
    with pytest.raises(SpecError) as info:
        load(tmp_path, """
            [stack]
            include = ["etcd.toml"]
            [units.etcd]
            command = ["again"]
        """)
    assert "also defined in" in str(info.value) and "etcd.toml" in str(info.value)


def test_a_file_included_twice_counts_once(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[units.c]\ncommand = ["c"]\n')
    (tmp_path / "a.toml").write_text('[stack]\ninclude = ["c.toml"]\n[units.a]\ncommand = ["a"]\n')
    (tmp_path / "b.toml").write_text('[stack]\ninclude = ["c.toml"]\n[units.b]\ncommand = ["b"]\n')
    stack = load(tmp_path, '[stack]\ninclude = ["a.toml", "b.toml"]\n')
    assert sorted(stack.units) == ["a", "b", "c"]
    # a second file defining the same unit is still refused, naming both files
    (tmp_path / "b.toml").write_text('[units.c]\ncommand = ["other"]\n')
    with pytest.raises(SpecError) as info:
        load(tmp_path, '[stack]\ninclude = ["a.toml", "b.toml"]\n')
    assert str(info.value).startswith(f"{tmp_path / 'b.toml'}, unit 'c'")
    assert f"also defined in {tmp_path / 'c.toml'}" in str(info.value)


def test_missing_include_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load(tmp_path, '[stack]\ninclude = ["nope.toml"]\n')
    assert "nope.toml" in str(info.value) and "not found" in str(info.value)


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load(tmp_path, "[units.a\ncommand=")
    assert "not valid TOML" in str(info.value)


def test_unknown_top_level_table(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load(tmp_path, '[unit.a]\ncommand = ["a"]\n')
    assert info.value.field == "unit"


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, """
        [units.a]
        command = ["a"]
        colour = "red"
        [units.b]
        command = ["b"]
        size = 3
    """)
    assert {(e.unit, e.field) for e in errs} == {("a", "colour"), ("b", "size")}


def test_stock_stacks_validate() -> None:
    root = Path(__file__).resolve().parents[2] / "units" / "stacks"
    counter = itertools.count(41000)
    for path in sorted(root.glob("*.toml")):
        stack = spec.load(path, state_dir=Path("/tmp/x"), allocate_port=lambda: next(counter))
        assert stack.units, path


SPARES_STACK = """
    [vars]
    workers = 2
    spares = 1
    [units.worker]
    replicas = "{vars.workers}"
    command = ["w"]
    dynamo = { system_url = "http://127.0.0.1:1", etcd = "http://127.0.0.1:2", namespace = "t" }
    [policy]
    store = "file"
    shards = ["worker"]
    spares = "{vars.spares}"
"""


def test_spares_add_instances_beside_the_serving_shards(tmp_path: Path) -> None:
    stack = load(tmp_path, SPARES_STACK)
    policy = policy_of(stack)
    assert policy is not None and policy.spares == 1
    assert shards(stack) == ["worker@0", "worker@1", "worker@2"]
    assert shards(load(tmp_path, SPARES_STACK, spares=0)) == ["worker@0", "worker@1"]


@pytest.mark.parametrize("value", ["x", "-1", "true"])
def test_bad_spares_names_the_policy_field(tmp_path: Path, value: str) -> None:
    with pytest.raises(SpecErrors) as info:
        load(tmp_path, SPARES_STACK, spares=value)
    (error,) = info.value.errors
    assert error.field == "policy.spares" and "must be an integer between 0 and" in error.message


def test_spares_need_one_shard_unit_with_replicas(tmp_path: Path) -> None:
    two = SPARES_STACK.replace('shards = ["worker"]', 'shards = ["worker", "other"]')
    (error,) = errors_of(tmp_path, two)
    assert error.field == "policy.spares" and "exactly one shard unit" in error.message
    single = SPARES_STACK.replace('replicas = "{vars.workers}"', "")
    (error,) = errors_of(tmp_path, single)
    assert "to have replicas" in error.message


def _based(tmp_path: Path) -> None:
    """A base stack file (cluster-like: vars, [cluster], an include, a unit)."""
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "etcd.toml").write_text(
        '[vars]\nport = 2379\n[units.etcd]\ncommand = ["etcd", "{vars.port}"]\n')
    (tmp_path / "base.toml").write_text(textwrap.dedent("""
        [stack]
        name = "base"
        max_starting = 2
        include = ["parts/etcd.toml"]
        [cluster]
        nodes = { head = "10.0.0.1" }
        [vars]
        workers = 1
        host = "127.0.0.1"
        etcd_client_port = 2379
        [units.worker]
        replicas = "{vars.workers}"
        command = ["w", "{vars.host}"]
    """))


def test_a_stack_on_a_base_takes_its_units_and_tables_and_overrides_its_vars(
    tmp_path: Path,
) -> None:
    _based(tmp_path)
    (tmp_path / "ray.toml").write_text('[units.ray]\ncommand = ["ray", "{vars.host}"]\n')
    stack = load(tmp_path, """
        [stack]
        base = "base.toml"
        include = ["ray.toml"]
        [vars]
        host = "0.0.0.0"
        workers = 2
    """)
    assert list(stack.units) == ["etcd", "worker@0", "worker@1", "ray"]
    assert stack.units["worker@1"].command == ["w", "0.0.0.0"]
    assert stack.units["ray"].command == ["ray", "0.0.0.0"]
    assert stack.units["etcd"].command == ["etcd", "2379"]
    assert stack.name == "stack"  # its own (the file's name), not the base's
    assert stack.cluster is not None and stack.cluster.nodes == {"head": "10.0.0.1"}
    assert stack.max_starting == 2
    # --var still overrides both
    assert load(tmp_path, '[stack]\nbase = "base.toml"\n', host="10.0.0.9").units[
        "worker@0"].command == ["w", "10.0.0.9"]


def test_a_root_table_of_the_stack_file_replaces_its_base_s(tmp_path: Path) -> None:
    _based(tmp_path)
    stack = load(tmp_path, """
        [stack]
        name = "mine"
        base = "base.toml"
        [cluster]
        nodes = { head = "10.0.0.1", n1 = "10.0.0.2" }
    """)
    assert stack.name == "mine"
    assert stack.cluster is not None and set(stack.cluster.nodes) == {"head", "n1"}


def test_a_base_refused_where_it_is_wrong(tmp_path: Path) -> None:
    _based(tmp_path)
    cases = {
        # a unit both define: the stack file is named, with the base's file
        '[stack]\nbase = "base.toml"\n[units.worker]\ncommand = ["x"]\n': (
            "stack.toml", "also defined in"),
        '[stack]\nbase = "nope.toml"\n': ("stack.toml", "base"),
        '[stack]\nbase = 3\n': ("stack.toml", "must be a stack file's path"),
        '[stack]\nbase = "stack.toml"\n': ("stack.toml", "base cycle"),
    }
    for text, (file, words) in cases.items():
        with pytest.raises(SpecError) as info:
            load(tmp_path, text)
        assert Path(str(info.value.file)).name == file, text
        assert words in str(info.value), (text, str(info.value))
    with pytest.raises(SpecError) as info:
        load(tmp_path, '[stack]\nbase = "nope.toml"\n')
    missing = str(info.value)
    assert "nope.toml" in missing and "not found" in missing and "stack.base" in missing
    # only a stack file has a base: an included file that names one is refused
    (tmp_path / "part.toml").write_text('[stack]\nbase = "base.toml"\n')
    with pytest.raises(SpecError) as info:
        load(tmp_path, '[stack]\ninclude = ["part.toml"]\n')
    assert info.value.file == str(tmp_path / "part.toml") and info.value.field == "stack.base"
