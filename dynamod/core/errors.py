"""Every error dynamod raises derives from DynamodError and carries its context."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynamod.core.limits import MAX_REPORTED_ERRORS

_PART_MAX = 200  # characters of one file name, unit name or field shown in a message
_MESSAGE_MAX = 1000


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (newline, escape, bidi
    override, lone surrogate) written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def shown(text: str) -> str:
    """A file, unit or field name fit for one line: printable, long names cut. They come
    from hostile input too."""
    text = printable(text)
    return text if len(text) <= _PART_MAX else text[: _PART_MAX - 3] + "..."


class DynamodError(Exception):
    """Base class: an operator-readable message plus structured context."""


class UnknownUnit(DynamodError):
    """A command named a unit the stack does not have (bad input: exit 2)."""


class SpecError(DynamodError):
    """A unit or stack file is invalid. Names the file, the unit and the field."""

    def __init__(
        self,
        message: str,
        *,
        file: Path | str | None = None,
        unit: str | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.file = str(file) if file is not None else None
        self.unit = unit
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(shown(self.file))
        if self.unit:
            where.append(f"unit '{shown(self.unit)}'")
        if self.field:
            where.append(f"field '{shown(self.field)}'")
        prefix = ", ".join(where) if where else "spec"
        message = printable(" ".join(self.message.splitlines()))
        if len(message) > _MESSAGE_MAX:
            message = message[: _MESSAGE_MAX - 3] + "..."
        return f"{prefix}: {message}"


class SpecErrors(DynamodError):
    """Several spec errors found in one pass; all are reported at once."""

    def __init__(self, errors: Sequence[SpecError], *, more: bool = False) -> None:
        self.errors = list(errors)
        self.more = more  # validation stopped early: there may be more problems
        super().__init__(str(self))

    def __str__(self) -> str:
        if len(self.errors) == 1 and not self.more:
            return str(self.errors[0])
        count = f"{len(self.errors)}{'+' if self.more else ''}"
        lines = [f"{count} problems in the stack:"]
        lines += [f"  - {e}" for e in self.errors[:MAX_REPORTED_ERRORS]]
        if len(self.errors) > MAX_REPORTED_ERRORS:
            lines.append(f"  ... and {len(self.errors) - MAX_REPORTED_ERRORS} more")
        return "\n".join(lines)


class CycleError(SpecError):
    """The dependency graph has a cycle; `cycle` lists it, first node repeated last."""

    def __init__(self, cycle: Sequence[str], file: Path | str | None = None) -> None:
        self.cycle = list(cycle)
        super().__init__(
            "dependency cycle: " + " -> ".join(self.cycle), file=file, field="depends_on"
        )


class PreflightError(DynamodError):
    """Something the stack needs is missing on this machine (executable, free port)."""


class StateDirError(DynamodError):
    """The state dir cannot be used (cannot be created, not a directory, not writable,
    too deep for the control socket). Found before anything is created or spawned."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"state dir {shown(self.path)}: {problem}")


class DaemonError(DynamodError):
    """Talking to the dynamod daemon failed (not running, refused, bad answer)."""


class UnitFailed(DynamodError):
    """A unit could not be brought to its required state."""

    def __init__(self, unit: str, reason: str) -> None:
        self.unit = unit
        self.reason = reason
        super().__init__(f"{unit}: {reason}")
