"""Stack variables: what a stack declares and references, `--var`s that name none of
them refused with the closest names, and docs/stack-variables.md kept to the stock stacks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.control import stackvars
from dynamod.core import spec
from dynamod.core.errors import SpecError
from dynamod.core.paths import units_dir
from tests import cli_inprocess

ROOT = Path(__file__).resolve().parents[2]
LOCAL = units_dir() / "stacks" / "local.toml"


def raw_of(tmp_path: Path, text: str, **overrides: object) -> spec.RawStack:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    return spec.load_stack(path, overrides)


def test_declared_and_referenced_variables(tmp_path: Path) -> None:
    (tmp_path / "inc.toml").write_text('[vars]\nport = 80\nname = "inc"\n')
    raw = raw_of(tmp_path, """
        [stack]
        include = ["inc.toml"]
        [vars]
        name = "top"
        dir = "{state_dir}/{vars.name}"
        [units.a]
        command = ["serve", "{vars.dir}", "--model", "{vars.model}", "{ports.p}", "{{vars.no}}"]
    """)
    assert spec.variables(raw) == {
        "dir": spec.Variable("dir", "{state_dir}/{vars.name}"),
        "name": spec.Variable("name", "top"),  # the stack file's default wins
        "port": spec.Variable("port", 80),
        "stack_id": spec.Variable("stack_id", "s"),  # every stack's: its name by default
        "model": spec.Variable("model", required=True),  # only referenced: --var gives it
    }


def test_overrides_keep_the_defaults_apart(tmp_path: Path) -> None:
    raw = raw_of(tmp_path, '[vars]\nworkers = 2\n[units.a]\ncommand = ["x"]\n', workers=4)
    builtin = {"stack_id": "s"}  # every stack has it (its identity, rollout/identity.py)
    assert raw.vars == {**builtin, "workers": 4} and raw.defaults == {**builtin, "workers": 2}


@pytest.mark.parametrize("name, hint", [
    ("worker", "did you mean `workers`"),
    ("Workers", "did you mean `workers`"),
    ("trainer_step", "did you mean `trainer_steps`"),
])
def test_a_typo_is_refused_with_the_closest_name(name: str, hint: str) -> None:
    raw = spec.load_stack(LOCAL)
    with pytest.raises(SpecError) as caught:
        spec.check_overrides(raw, {"workers": 3, name: 1})
    err = caught.value
    assert (err.file, err.field) == (str(LOCAL), "--var")
    assert f"no variable {name!r}" in err.message and hint in err.message
    assert "\n" not in str(err)


def test_several_unknown_in_one_line_and_a_list_when_nothing_is_close(tmp_path: Path) -> None:
    raw = raw_of(tmp_path, '[vars]\nalpha = 1\nbeta = 2\n[units.a]\ncommand = ["x"]\n')
    with pytest.raises(SpecError) as caught:
        spec.check_overrides(raw, {"alpah": 1, "zzz": 2})
    message = caught.value.message
    assert "no variables 'alpah' (did you mean `alpha`?)" in message
    assert "'zzz' (its variables: alpha, beta, stack_id)" in message and "\n" not in message
    bare = raw_of(tmp_path, '[units.a]\ncommand = ["x"]\n')
    with pytest.raises(SpecError, match=r"its variables: stack_id\)"):
        spec.check_overrides(bare, {"x": 1})


def test_load_refuses_an_unknown_var_before_rendering(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[vars]\nn = 1\n[units.a]\ncommand = ["x"]\nreplicas = "{vars.n}"\n')
    with pytest.raises(SpecError, match="no variable 'm'"):
        spec.load(path, state_dir=tmp_path, allocate_port=lambda: 1, var_overrides={"m": 2})
    stack = spec.load(path, state_dir=tmp_path, allocate_port=lambda: 1, var_overrides={"n": 2})
    assert list(stack.units) == ["a@0", "a@1"]


NAMES = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz_-0123456789"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(declared=st.dictionaries(NAMES, st.integers(), max_size=6), given_=st.data())
def test_exactly_the_unknown_names_are_refused(
    declared: dict[str, int], given_: st.DataObject
) -> None:
    raw = spec.RawStack(path=Path("/s.toml"), name="s", defaults=declared)
    known = given_.draw(st.lists(st.sampled_from(sorted(declared)), unique=True)
                        if declared else st.just([]))
    spec.check_overrides(raw, dict.fromkeys(known, 1))  # names the stack has: accepted
    unknown = given_.draw(NAMES.filter(lambda n: n not in declared))
    with pytest.raises(SpecError) as caught:
        spec.check_overrides(raw, {**dict.fromkeys(known, 1), unknown: 1})
    # the one unknown name is named, and only it: the known ones at most as hints
    assert caught.value.message.startswith(f"the stack has no variable {unknown!r}")
    assert "\n" not in str(caught.value)


def test_check_lists_the_variables_with_defaults_and_overrides(tmp_path: Path) -> None:
    result = cli_inprocess.run(["--state-dir", str(tmp_path / "s"), "check", "local", "--vars",
                                "--var", "workers=3"])
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "workers = 2  [--var workers=3]" in lines and 'model_name = "tiny-cpu"' in lines
    assert len(lines) == len(spec.variables(spec.load_stack(LOCAL)))


def test_the_stack_variables_page_is_current() -> None:
    page = ROOT / "docs" / "stack-variables.md"
    assert page.read_text() == stackvars.page(), (
        "docs/stack-variables.md is stale: python -m dynamod.control.stackvars > "
        "docs/stack-variables.md"
    )
    for stack in stackvars.stock_stacks():
        assert f"## {stack.stem}\n" in page.read_text()


def test_the_page_test_fails_on_a_variable_it_does_not_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "mine.toml").write_text('[vars]\nfresh = 1\n[units.a]\ncommand = ["x"]\n')
    monkeypatch.setattr(stackvars.paths, "units_dir", lambda: tmp_path)
    page = stackvars.page()
    assert "## mine" in page and "| `fresh` | `1` |" in page
    assert page != (ROOT / "docs" / "stack-variables.md").read_text()


def test_a_chaos_run_refuses_a_runbook_var_its_stack_lacks(tmp_path: Path) -> None:
    book = (ROOT / "runbooks" / "frontend-crash.toml").read_text()
    assert "trainer_steps = 0" in book
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "frontend-crash.toml").write_text(
        book.replace("trainer_steps = 0", "trainer_step = 0"))
    report = tmp_path / "report"
    result = cli_inprocess.run(["chaos", "run", "--runbooks", str(tmp_path / "books"),
                                "--report", str(report), "frontend-crash"])
    assert result.code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no variable 'trainer_step'" in result.stderr and str(LOCAL) in result.stderr
    assert "did you mean `trainer_steps`" in result.stderr and not report.exists()
