"""Stack variables from the command line: `--var key=value`."""

from __future__ import annotations

from typing import Any

from dynamod.core.errors import SpecError


def parse_var(text: str) -> tuple[str, Any]:
    """`--var key=value`: ints stay ints so `replicas = "{vars.workers}"` just works."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SpecError(f"--var expects key=value, got {text!r}", field="--var")
    try:
        return key, int(value)
    except ValueError:
        return key, value
