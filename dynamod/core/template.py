"""`{dotted.reference}` substitution in unit fields.

A reference names a value in a nested mapping: `{ports.client}`, `{units.etcd.ports.client}`,
`{vars.workers}`, `{index}`. `{{` and `}}` stand for literal braces. An unknown reference is
an error that names the reference, so a typo never reaches a command line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_REF = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_@\-]*(?:\.[A-Za-z0-9_@\-]+)*)\}")


class TemplateError(Exception):
    def __init__(self, reference: str, known: list[str]) -> None:
        self.reference = reference
        self.known = known
        hint = f" (known here: {', '.join(known)})" if known else ""
        super().__init__(f"unknown reference {{{reference}}}{hint}")


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


def render(text: str, context: Mapping[str, Any]) -> str:
    def substitute(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        value = lookup(context, match.group(1))
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return _REF.sub(substitute, text)
