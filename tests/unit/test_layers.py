"""The folders are the layers (DESIGN.md): imports between dynamod's folders point down
only. Read from the source with `ast`, so a folder-level cycle (chaos -> control -> chaos,
as once through control/client.py) fails here before a merge, not at import time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dynamod"

# What each folder may import (besides itself); anything else points up or sideways.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "client": {"core"},
    "rollout": {"core"},
    "ops": {"core"},
    "workers": {"core"},
    "trainer": {"core", "client", "workers"},
    "chaos": {"core", "client", "rollout", "ops"},
    "integrations": {"core", "client", "rollout", "workers"},
    "cluster": {"core", "client", "rollout"},
    "control": {"core", "client", "rollout", "ops", "chaos", "cluster"},
}


def folder_imports(package: Path) -> dict[str, dict[str, set[str]]]:
    """folder -> imported folder -> the files that import it."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if len(rel.parts) < 2:
            continue
        source = rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "dynamod" and len(parts) > 1 and parts[1] != source:
                    found.setdefault(source, {}).setdefault(parts[1], set()).add(str(rel))
    return found


def violations(found: dict[str, dict[str, set[str]]]) -> list[str]:
    out = []
    for source, targets in sorted(found.items()):
        allowed = ALLOWED.get(source)
        for target, files in sorted(targets.items()):
            if allowed is None or target not in allowed:
                out.append(f"{source} -> {target} ({', '.join(sorted(files))})")
    return out


def test_every_folder_imports_only_the_layers_below_it() -> None:
    assert violations(folder_imports(PACKAGE)) == []


def test_the_allowed_table_itself_has_no_cycle() -> None:
    seen: set[str] = set()

    def visit(folder: str, path: tuple[str, ...]) -> None:
        assert folder not in path, " -> ".join((*path, folder))
        if folder in seen:
            return
        for below in ALLOWED.get(folder, set()):
            visit(below, (*path, folder))
        seen.add(folder)

    for folder in ALLOWED:
        visit(folder, ())


@pytest.mark.parametrize("line, expect", [
    ("from dynamod.control.cli import main", ["chaos -> control (chaos/x.py)"]),
    ("from dynamod.core.errors import SpecError", []),
])
def test_an_upward_import_is_caught(tmp_path: Path, line: str, expect: list[str]) -> None:
    (tmp_path / "chaos").mkdir()
    (tmp_path / "chaos" / "x.py").write_text(line + "\n")
    assert violations(folder_imports(tmp_path)) == expect
