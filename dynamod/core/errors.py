"""Every error dynamod raises derives from DynamodError and carries its context."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class DynamodError(Exception):
    """Base class: an operator-readable message plus structured context."""


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
            where.append(self.file)
        if self.unit:
            where.append(f"unit {self.unit!r}")
        if self.field:
            where.append(f"field {self.field!r}")
        prefix = ": ".join([", ".join(where)]) if where else "spec"
        return f"{prefix}: {self.message}"


class SpecErrors(DynamodError):
    """Several spec errors found in one pass; all are reported at once."""

    def __init__(self, errors: Sequence[SpecError]) -> None:
        self.errors = list(errors)
        super().__init__(str(self))

    def __str__(self) -> str:
        if len(self.errors) == 1:
            return str(self.errors[0])
        lines = [f"{len(self.errors)} problems in the stack:"]
        lines += [f"  - {e}" for e in self.errors]
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


class DaemonError(DynamodError):
    """Talking to the dynamod daemon failed (not running, refused, bad answer)."""


class UnitFailed(DynamodError):
    """A unit could not be brought to its required state."""

    def __init__(self, unit: str, reason: str) -> None:
        self.unit = unit
        self.reason = reason
        super().__init__(f"{unit}: {reason}")
