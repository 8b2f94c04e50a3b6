"""Rendering a stack's strings within its output budget, reading integers out of TOML or
rendered templates, and turning pydantic's errors into SpecErrors that name the file, the
unit and the field as the user wrote them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from dynamod.core import limits
from dynamod.core.errors import SpecError, SpecErrors
from dynamod.core.spec.files import RawUnit
from dynamod.core.template import TemplateError, render


class Renderer:
    """Renders the strings of unit fields within the stack's output budget: every string
    at most MAX_RENDERED_CHARS, everything rendered for the stack (replicas repeat their
    unit) at most MAX_RENDERED_TOTAL, so no stack renders itself into memory exhaustion."""

    _PER_VALUE = 8

    def __init__(self) -> None:
        self.left = limits.MAX_RENDERED_TOTAL

    def field(self, value: Any, context: Mapping[str, Any], raw: RawUnit, where: str) -> Any:
        """Render strings in `value`, turning template errors into SpecErrors at `where`."""
        if isinstance(value, str):
            try:
                out = render(value, context, limits.MAX_RENDERED_CHARS)
            except TemplateError as exc:
                raise SpecError(str(exc), file=raw.source, unit=raw.name, field=where) from None
            self._spend(len(out) + self._PER_VALUE, raw, where)
            return out
        self._spend(self._PER_VALUE, raw, where)
        if isinstance(value, dict):
            return {
                k: self.field(v, context, raw, f"{where}.{k}" if where else k)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.field(v, context, raw, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    def _spend(self, amount: int, raw: RawUnit, where: str) -> None:
        self.left -= amount
        if self.left < 0:
            raise SpecError(
                f"the stack renders to more than {limits.MAX_RENDERED_TOTAL} characters "
                "(every replica repeats its unit's fields); make it smaller",
                file=raw.source,
                unit=raw.name,
                field=where or None,
            )


def as_int(value: Any, raw: RawUnit, where: str, minimum: int, maximum: int) -> int:
    """An integer from TOML or a rendered template; floats and booleans are not integers."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise SpecError(
            f"must be an integer, got {short_repr(value)}",
            file=raw.source,
            unit=raw.name,
            field=where,
        )
    if not minimum <= number <= maximum:
        raise SpecError(
            f"must be between {minimum} and {maximum}, got {number}",
            file=raw.source,
            unit=raw.name,
            field=where,
        )
    return number


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pydantic_errors(
    exc: ValidationError, raw: RawUnit, instance: str, *, prefix: str = ""
) -> list[SpecError]:
    """One SpecError per problem, at the field as written (`prefix` + its location)."""
    errors = []
    for err in exc.errors(include_url=False)[: limits.MAX_REPORTED_ERRORS]:
        loc = ".".join([*([prefix] if prefix else []), *(str(p) for p in err["loc"])])
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required but missing"
        elif err["type"] == "value_error":  # our own validators; they quote the value
            message = str(err.get("ctx", {}).get("error", err["msg"]))
        else:
            message = err["msg"]
            if "input" in err and not isinstance(err["input"], dict | list):
                message += f" (got {short_repr(err['input'])})"
        errors.append(SpecError(message, file=raw.source, unit=instance, field=loc or None))
    return errors


def check_error_count(errors: list[SpecError]) -> None:
    """Stop early once enough is wrong: a hostile stack must not cost a problem per byte."""
    if len(errors) >= limits.MAX_COLLECTED_ERRORS:
        raise SpecErrors(errors[: limits.MAX_COLLECTED_ERRORS], more=True)
