"""The bounds on what a stack file may ask for, in one place.

Values with no natural bound (replicas, ports, timeouts, sizes, include depth, number of
units, template output) get one here, so a hostile or mistyped stack is refused with the
file, unit and field named instead of exhausting memory or time. The README's unit-file
section lists them; change both together.
"""

from __future__ import annotations

import re

UNIT_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
"""A unit name's alphabet: it becomes a log file name, a URL path and a systemd name."""

MAX_FILE_BYTES = 1024 * 1024
"""A stack or unit file larger than this is refused before it is parsed."""

MAX_NESTING = 32
"""Tables and arrays nested deeper than this (counted from the file's top level)."""

MAX_INCLUDE_DEPTH = 8
"""Stack file -> include -> include ...: at most this many levels below the stack file."""

MAX_FILES = 64
"""Files read for one stack, the stack file and every include together."""

MAX_INSTANCES = 256
"""Unit instances in one stack after replicas are expanded (so also the replica bound)."""

MAX_NAME_LENGTH = 64
"""Characters in a unit name (a replica's `@N` suffix not counted); it names a log file."""

_INSTANCE = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_NAME_LENGTH}}}(@[0-9]{{1,3}})?")


def is_instance_name(text: str) -> bool:
    """`NAME` or `NAME@N` as a stack can define it (what `logs` and `restart` accept)."""
    return _INSTANCE.fullmatch(text) is not None


MAX_ALLOCATED_PORTS = 1024
"""Ports given `0` (a free loopback port is allocated) in one stack."""

MAX_PORT = 65535

MAX_PORTS_PER_UNIT = 64
"""Named ports of one unit."""

MAX_SECONDS = 86400.0
"""Every duration (probe interval, timeout, deadline, backoff, stop timeout): one day."""

MAX_COUNT = 10000
"""Counters such as failure_threshold and limit_burst."""

MAX_RENDERED_CHARS = 64 * 1024
"""One string after template rendering (Linux allows 128 KiB per command-line argument)."""

MAX_RENDERED_TOTAL = 8 * 1024 * 1024
"""Everything rendered for one stack: characters of every string plus 8 per other value."""

MAX_REPORTED_ERRORS = 20
"""Problems listed for one invalid stack; the rest are counted, not printed."""

MAX_COLLECTED_ERRORS = 100
"""Validation stops collecting problems after this many (the count is then "100+")."""
