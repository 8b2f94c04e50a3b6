"""Reading a unit's command line: the value a flag is given, as `--flag value` or
`--flag=value`. Used where a layer needs what a command asks of a process without parsing
its whole argument list (the exposure check, verl's view of the stack, chaos)."""

from __future__ import annotations

from collections.abc import Sequence


def flag_value(command: Sequence[str], flag: str) -> str | None:
    """The value of the first `flag` on `command` (None if absent or last with no value)."""
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return str(command[i + 1])
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
