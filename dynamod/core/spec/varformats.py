"""What a stack variable's value must look like: `[var_formats]` in a stack or unit file
names a format for some of its `[vars]`, and each such value (its default, or what `--var`
gave) is checked once it is rendered, before anything starts. A var that only flows into
a command line is opaque to the rest of the spec; without a format a bad value would
surface as the program's own error, after the stack had begun to start.

    [vars]
    etcd_history = "1h"

    [var_formats]
    etcd_history = "duration"

The formats, each for a kind of value the stock units pass on:
  duration  a duration as etcd and Go read it: 1h, 10m, 90s, 1h30m, 1.5h; or a whole
            number (etcd: hours; 0: off)
  count     a whole number, 0 or more
  seconds   a whole number of seconds above 0 (Dynamo's ETCD_LEASE_TTL is one)
  port      a TCP port, 1-65535
  address   an IP address to listen on: 127.0.0.1, 0.0.0.0 (every interface), 10.0.0.5, ::1
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dynamod.core.errors import SpecError

# Go's time.ParseDuration, less signs and the ns/us units no stock var wants; etcd reads a
# bare whole number as hours (its periodic compaction retention)
DURATION = re.compile(r"[0-9]+|([0-9]+(\.[0-9]+)?(h|m|s|ms))+")
_PORT_MAX = 65535


def _whole(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _is_duration(value: Any) -> bool:
    if isinstance(value, str):
        return bool(DURATION.fullmatch(value))
    hours = _whole(value)  # `--var etcd_history=2` arrives as an int
    return hours is not None and hours >= 0


def _is_count(value: Any) -> bool:
    count = _whole(value)
    return count is not None and count >= 0


def _is_seconds(value: Any) -> bool:
    seconds = _whole(value)
    return seconds is not None and seconds > 0


def _is_port(value: Any) -> bool:
    port = _whole(value)
    return port is not None and 1 <= port <= _PORT_MAX


def _is_address(value: Any) -> bool:
    try:
        ipaddress.ip_address(value if isinstance(value, str) else "")
    except ValueError:
        return False
    return True


# format -> (check, what it expects, in words)
FORMATS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "duration": (_is_duration, "a duration such as 1h, 10m or 90s, or a whole number"),
    "count": (_is_count, "a whole number, 0 or more"),
    "seconds": (_is_seconds, "a whole number of seconds above 0"),
    "port": (_is_port, f"a TCP port, 1-{_PORT_MAX}"),
    "address": (_is_address, "an IP address such as 127.0.0.1 or 0.0.0.0"),
}


def check_declared(formats: Mapping[str, Any], file_vars: Mapping[str, Any], path: Path) -> None:
    """A file's `[var_formats]`: each names a known format, for a var the file declares."""
    for name, format_name in formats.items():
        where = f"var_formats.{name}"
        if not isinstance(format_name, str) or format_name not in FORMATS:
            known = ", ".join(FORMATS)
            message = f"unknown format {format_name!r} (one of: {known})"
            raise SpecError(message, file=path, field=where)
        if name not in file_vars:
            raise SpecError(
                f"a format for {name!r}, which this file's [vars] does not declare",
                file=path,
                field=where,
            )


def check_values(
    values: Mapping[str, Any],
    formats: Mapping[str, str],
    given: Mapping[str, Any],
    path: Path,
) -> None:
    """Each var with a format, as rendered: one line naming the var, its value and what it
    must be. `given`: the `--var` overrides, so the line says where the value came from."""
    for name, format_name in formats.items():
        if name not in values:
            continue
        check, expected = FORMATS[format_name]
        value = values[name]
        if not check(value):
            field = f"--var {name}" if name in given else f"vars.{name}"
            raise SpecError(f"must be {expected}, got {value!r}", file=path, field=field)
