"""Stack variables: what a stack declares (`[vars]` defaults, the stack file's over its
includes') and references (`{vars.NAME}` with no default: `--var` must give it), and the
`--var key=value` overrides, which must name one of them: a typo is refused with the
closest names, never silently ignored."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dynamod.core import placement
from dynamod.core.errors import SpecError
from dynamod.core.spec.files import RawStack
from dynamod.core.template import references

_HINTS = 3  # closest names offered for a typo
_LISTED = 20  # known names listed when none is close


@dataclass(frozen=True)
class Variable:
    """One stack variable; `required`: referenced with no default, so `--var` gives it;
    `format`: what its value must be (`[var_formats]`, core/spec/varformats), if declared."""

    name: str
    default: Any = None
    required: bool = False
    format: str | None = None


def parse_var(text: str) -> tuple[str, Any]:
    """`--var key=value`: ints stay ints so `replicas = "{vars.workers}"` just works."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SpecError(f"--var expects key=value, got {text!r}", field="--var")
    try:
        return key, int(value)
    except ValueError:
        return key, value


def variables(raw: RawStack) -> dict[str, Variable]:
    """Every variable the stack knows, by name: declared ones with their defaults, then
    those its templates reference without a default."""
    known = {
        name: Variable(name, value, format=raw.formats.get(name))
        for name, value in sorted(raw.defaults.items())
    }
    for name in sorted(referenced(raw) - set(known)):
        known[name] = Variable(name, required=True)
    return known


def referenced(raw: RawStack) -> set[str]:
    """The NAMEs of `{vars.NAME...}` anywhere in the stack's tables."""
    tables: list[Any] = [raw.defaults, raw.tables, raw.cluster or {}]
    tables += [unit.table for unit in raw.units.values()]
    if raw.cluster is not None and "registry" not in raw.cluster:
        tables.append(placement.DEFAULT_REGISTRY)
    found = set()
    for text in _strings(tables):
        for reference in references(text):
            head, _, rest = reference.partition(".")
            if head == "vars" and rest:
                found.add(rest.partition(".")[0])
    return found


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def check_overrides(raw: RawStack, overrides: Mapping[str, Any]) -> None:
    """Refuse `--var`s that name no variable of the stack, in one line naming each with
    the closest known names."""
    known = variables(raw)
    unknown = [name for name in overrides if name not in known]
    if not unknown:
        return
    problems = [f"{name!r}{_hint(name, list(known))}" for name in unknown]
    noun = "variable" if len(unknown) == 1 else "variables"
    raise SpecError(f"the stack has no {noun} {'; '.join(problems)}", file=raw.path, field="--var")


def _hint(name: str, known: list[str]) -> str:
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=_HINTS, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(f"`{by_lower[c]}`" for c in close) + "?)"
    if not known:
        return " (it has no variables)"
    listed = known[:_LISTED] + (["..."] if len(known) > _LISTED else [])
    return f" (its variables: {', '.join(listed)})"
