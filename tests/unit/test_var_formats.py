"""`[var_formats]`: a var with a declared format is checked once rendered, before anything
starts, in one line naming the file and the var; a declaration itself is checked too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.core import spec
from dynamod.core.errors import SpecError, SpecErrors
from dynamod.core.paths import units_dir
from dynamod.core.spec.varformats import FORMATS

ACCEPTED = {
    "duration": ["1h", "10m", "90s", "1h30m", "1.5h", "500ms", "0", 0, 2, "24"],
    "count": [0, 3, "0", "12"],
    "seconds": [1, 300, "30"],
    "port": [1, 2379, "65535"],
    "address": ["127.0.0.1", "0.0.0.0", "10.77.0.2", "::1"],
}
REFUSED = {
    # a fullwidth 1, an Arabic-Indic 3: digits to str.isdigit, not to etcd
    "duration": ["bogus", "1x", "-1h", -1, "h", "1 h", "", "1.h", 1.5, True, "\uff11h"],
    "count": [-1, "-1", "1.5", 1.5, "three", "", True, "\u0663"],
    "seconds": [0, "0", -5, 1.5, "30s", "", False],
    "port": [0, 65536, "70000", "http", -1, 80.0, True],
    "address": ["localhost", "", "10.77.0", "256.0.0.1", 0, "0.0.0.0:80", None],
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_accepts_its_values_and_refuses_the_rest(name: str) -> None:
    check, _ = FORMATS[name]
    assert [v for v in ACCEPTED[name] if not check(v)] == []
    assert [v for v in REFUSED[name] if check(v)] == []


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.text(max_size=12), st.integers(), st.floats(), st.booleans()))
def test_no_value_makes_a_format_check_raise(value: object) -> None:
    for check, _ in FORMATS.values():
        assert check(value) in (True, False)


@settings(max_examples=100, deadline=None)
@given(port=st.integers(min_value=-(2**40), max_value=2**40))
def test_a_port_is_exactly_1_to_65535(port: int) -> None:
    assert FORMATS["port"][0](port) is (1 <= port <= 65535)
    assert FORMATS["port"][0](str(port)) is (1 <= port <= 65535)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


STACK = """
    [vars]
    history = "1h"
    [var_formats]
    history = "duration"
    [units.a]
    command = ["x", "{vars.history}"]
"""


def resolve(path: Path, tmp_path: Path, **overrides: object) -> spec.Stack:
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: 1,
                     var_overrides=overrides)


def refusal(path: Path, tmp_path: Path, **overrides: object) -> SpecError:
    with pytest.raises(SpecErrors) as caught:
        resolve(path, tmp_path, **overrides)
    assert len(caught.value.errors) == 1
    return caught.value.errors[0]


def test_a_bad_var_is_refused_naming_the_stack_the_var_and_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, "s.toml", STACK)
    assert resolve(path, tmp_path, history="10m").units["a"].command == ["x", "10m"]
    err = refusal(path, tmp_path, history="bogus")
    assert (err.file, err.field) == (str(path), "--var history")
    assert "must be a duration" in err.message and "'bogus'" in err.message
    assert "\n" not in str(err)


def test_a_bad_default_is_refused_as_the_files_own(tmp_path: Path) -> None:
    path = write(tmp_path, "s.toml", STACK.replace('"1h"', '"one hour"'))
    err = refusal(path, tmp_path)
    assert (err.file, err.field) == (str(path), "vars.history")


def test_the_rendered_value_is_checked(tmp_path: Path) -> None:
    """A var made of another var is checked as it renders."""
    path = write(tmp_path, "s.toml", """
        [vars]
        minutes = 10
        history = "{vars.minutes}m"
        [var_formats]
        history = "duration"
        [units.a]
        command = ["x", "{vars.history}"]
    """)
    assert resolve(path, tmp_path).units["a"].command == ["x", "10m"]
    err = refusal(path, tmp_path, minutes="ten")
    assert err.field == "vars.history" and "'tenm'" in err.message


def test_an_included_files_format_holds_for_the_stacks_own_default(tmp_path: Path) -> None:
    write(tmp_path, "inc.toml", STACK)
    path = write(tmp_path, "s.toml", """
        [stack]
        include = ["inc.toml"]
        [vars]
        history = "forever"
    """)
    assert spec.load_stack(path).formats == {"history": "duration"}
    assert refusal(path, tmp_path).field == "vars.history"


@pytest.mark.parametrize("formats, expect", [
    ('history = "hours"',
     "unknown format 'hours' (one of: duration, count, seconds, port, address)"),
    ("history = 3", "unknown format 3"),
    ('other = "count"', "a format for 'other', which this file's [vars] does not declare"),
])
def test_a_bad_declaration_is_refused(tmp_path: Path, formats: str, expect: str) -> None:
    path = write(tmp_path, "s.toml", STACK.replace('history = "duration"', formats))
    with pytest.raises(SpecError) as caught:
        spec.load_stack(path)
    assert expect in caught.value.message and caught.value.file == str(path)
    assert caught.value.field is not None and caught.value.field.startswith("var_formats.")


def test_var_formats_must_be_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, "s.toml", 'var_formats = 1\n[units.a]\ncommand = ["x"]\n')
    with pytest.raises(SpecError, match="must be a table"):
        spec.load_stack(path)


def test_every_stock_format_names_a_var_whose_default_passes(tmp_path: Path) -> None:
    """The stock stacks resolve with their own defaults, and each declares the formats the
    issue asked for (a bad etcd history is refused up front everywhere etcd is started)."""
    for stack in sorted((units_dir() / "stacks").glob("*.toml")):
        raw = spec.load_stack(stack)
        for name, format_name in raw.formats.items():
            value = raw.defaults[name]
            if isinstance(value, str) and "{" in value:
                continue  # rendered from others, checked as it renders
            assert FORMATS[format_name][0](value), (stack.name, name, value)
    for stack in ("local", "infra", "cluster", "cluster-ha"):
        raw = spec.load_stack(units_dir() / "stacks" / f"{stack}.toml")
        assert raw.formats.get("etcd_history") == "duration", stack
