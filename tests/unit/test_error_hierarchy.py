"""Every error class dynamod defines (a name ending in Error) derives from DynamodError
(core/errors.py), so one `except DynamodError` at the edge turns any of them into one line for
the operator. Read from the source with `ast`, as the layer test does: no module is imported.
Exceptions used as signals between two functions (`_Done`, `graph.Cycle`) are not errors."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dynamod"
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def exception_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """class name -> the names of its bases, for every class in `sources` (file -> text)."""
    classes: dict[str, list[str]] = {}
    for file, text in sources.items():
        for node in ast.walk(ast.parse(text, file)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
    return classes


def outside_hierarchy(classes: dict[str, list[str]]) -> list[str]:
    """The error classes that do not reach DynamodError through their bases."""

    def reaches(name: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == target:
            return True
        if name in seen or name not in classes:
            return False
        return any(reaches(base, target, seen | {name}) for base in classes[name])

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in BUILTIN_ERRORS:
            return True
        if name in seen or name not in classes:
            return False
        return any(is_exception(base, seen | {name}) for base in classes[name])

    return sorted(
        name
        for name in classes
        if name.endswith("Error")
        and name != "DynamodError"
        and is_exception(name)
        and not reaches(name, "DynamodError")
    )


def test_every_dynamod_error_derives_from_dynamod_error() -> None:
    sources = {str(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert outside_hierarchy(exception_classes(sources)) == []


def test_the_check_finds_an_error_outside_the_hierarchy() -> None:
    sources = {
        "a.py": "class DynamodError(Exception): ...\nclass Good(DynamodError): ...\n",
        "b.py": "class BadError(ValueError): ...\nclass AlsoBadError(BadError): ...\n"
        "class FineError(Good, ValueError): ...\nclass NotAnError: ...\n",
    }
    assert outside_hierarchy(exception_classes(sources)) == ["AlsoBadError", "BadError"]
