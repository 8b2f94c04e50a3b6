"""docs/architecture.png is drawn from the code (scripts/draw_architecture.py). These tests
keep it true: every module and function the picture's paths name exists, no arrow between
layers points up, and the layer table on docs/architecture.md is the one the code gives.
After moving code: `.venv/bin/python scripts/draw_architecture.py`, then commit."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.test_layers import ALLOWED

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "draw_architecture.py"
REDRAW = "run .venv/bin/python scripts/draw_architecture.py and commit what it writes"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draw_architecture", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


arch = _load()


@pytest.fixture(scope="module")
def edges() -> dict[tuple[str, str], set[str]]:
    """The layer imports, read once for the module (parsing every file takes a second)."""
    found: dict[tuple[str, str], set[str]] = arch.layer_imports()
    return found


def test_every_step_of_the_three_paths_names_code_that_exists() -> None:
    assert set(arch.PATHS) == {
        "A request: client -> frontend -> worker",
        "A push: trainer -> ledger -> admit",
        "A kill: SIGKILL -> restart -> admit",
    }
    assert arch.missing_steps(arch.PATHS) == [], f"the picture names code that is gone; {REDRAW}"


def test_no_arrow_between_the_layers_points_up(edges: dict[tuple[str, str], set[str]]) -> None:
    rows = arch.rows(arch.layers_present(), edges)  # raises on an import circle
    assert arch.upward(edges, rows) == []
    assert rows["core"] == 0 and rows["control"] == max(rows.values())
    assert set(arch.LAYERS) == set(arch.layers_present()), "a layer without words in LAYERS"


def test_every_arrow_drawn_is_one_the_layer_rule_allows(
    edges: dict[tuple[str, str], set[str]],
) -> None:
    assert {(s, t) for s, t in edges if t not in ALLOWED.get(s, set())} == set()


def test_the_page_carries_the_layer_table_the_code_gives(
    edges: dict[tuple[str, str], set[str]],
) -> None:
    table = arch.table(edges, arch.rows(arch.layers_present(), edges))
    assert table in arch.PAGE.read_text(), f"docs/architecture.md's layer table is stale; {REDRAW}"
    assert arch.PNG.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The checkers above, each made to fail.

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "dynamod" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return tmp_path / "dynamod"


def test_a_step_naming_a_module_or_function_that_is_gone_is_reported(tmp_path: Path) -> None:
    package = _package(tmp_path, {"core/engine.py": "class Engine:\n    def admit(self): ...\n"})
    paths = {"p": [
        arch.Step("core/engine.py:Engine.admit", "kept"),
        arch.Step("core/engine.py:Engine.hold", "renamed"),
        arch.Step("core/gone.py", "moved"),
        arch.Step("dynamo.frontend", "not ours", external=True),
    ]}
    assert arch.missing_steps(paths, package) == [
        "p: core/engine.py:Engine.hold: dynamod/core/engine.py has no Engine.hold",
        "p: core/gone.py: no module dynamod/core/gone.py",
    ]


def test_an_import_circle_between_layers_has_no_rows(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "core/a.py": "from dynamod.rollout import b\n",
        "rollout/b.py": "from ..core import a\n",  # a relative import counts too
    })
    edges = arch.layer_imports(package)
    assert set(edges) == {("core", "rollout"), ("rollout", "core")}
    with pytest.raises(arch.CircleError, match=re.escape("core -> rollout -> core")):
        arch.rows(arch.layers_present(package), edges)


def test_an_arrow_up_is_reported_when_rows_are_given() -> None:
    assert arch.upward({("core", "control"), ("control", "core")}, {"core": 0, "control": 1}) == [
        "core -> control"
    ]


def test_a_stale_layer_table_is_replaced_not_appended() -> None:
    page = f"intro\n{arch.BEGIN}\nold\n{arch.END}\nrest\n"
    assert arch.with_table(page, f"{arch.BEGIN}\nnew\n{arch.END}") == (
        f"intro\n{arch.BEGIN}\nnew\n{arch.END}\nrest\n"
    )
