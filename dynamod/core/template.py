"""`{dotted.reference}` substitution in unit fields.

A reference names a value in a nested mapping: `{ports.client}`, `{units.etcd.ports.client}`,
`{vars.workers}`, `{index}`. `{{` and `}}` stand for literal braces. An unknown reference is
an error that names the reference, so a typo never reaches a command line. Output is
bounded: a string whose rendering would pass `max_length` characters is an error, found
before the long string is built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dynamod.core.errors import DynamodError

_REF = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_@\-]*(?:\.[A-Za-z0-9_@\-]+)*)\}")


_HINT_NAMES = 20


class TemplateError(DynamodError):
    """An unknown reference; names it and what is known at that level."""

    def __init__(self, reference: str, known: list[str]) -> None:
        self.reference = reference
        self.known = known
        shown = known[:_HINT_NAMES] + (["..."] if len(known) > _HINT_NAMES else [])
        hint = f" (known here: {', '.join(shown)})" if known else ""
        super().__init__(f"unknown reference {{{reference}}}{hint}")


class TemplateTooLong(TemplateError):
    """Rendering would produce more than `limit` characters."""

    def __init__(self, limit: int) -> None:
        self.reference = ""
        self.known = []
        self.limit = limit
        DynamodError.__init__(self, f"renders to more than {limit} characters")


def lookup(context: Mapping[str, Any], reference: str) -> Any:
    node: Any = context
    parts = reference.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            known = sorted(node) if isinstance(node, Mapping) else []
            prefix = ".".join(parts[:depth])
            raise TemplateError(reference, [f"{prefix}.{k}" if prefix else str(k) for k in known])
        node = node[part]
    if isinstance(node, Mapping):
        raise TemplateError(reference, [f"{reference}.{k}" for k in sorted(node)])
    return node


def references(text: str) -> list[str]:
    """The dotted references `text` makes (`{{` and `}}` are no references)."""
    return [match.group(1) for match in _REF.finditer(text) if match.group(1)]


def render(text: str, context: Mapping[str, Any], max_length: int | None = None) -> str:
    # The output is at most the template's own length plus what substitutions add.
    grown = len(text)

    def substitute(match: re.Match[str]) -> str:
        nonlocal grown
        token = match.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        value = lookup(context, match.group(1))
        out = ("true" if value else "false") if isinstance(value, bool) else str(value)
        grown += len(out) - len(token)
        if max_length is not None and grown > max_length:
            raise TemplateTooLong(max_length)
        return out

    if max_length is not None and len(text) > max_length:
        raise TemplateTooLong(max_length)
    return _REF.sub(substitute, text)
