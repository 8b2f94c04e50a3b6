"""The quantities of a unit's `limits` table as a stack file writes them, and back: sizes
("512M", "2G"), CPU percentages ("150%"), CPU lists ("0-1,4"). Pure functions; the
model is `models.LimitsSpec`."""

from __future__ import annotations

import os
import re
from typing import Any

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
MIN_MEMORY = 1 << 20  # 1M: below it nothing starts (python alone takes ~10M)
MAX_MEMORY = 1 << 50
MAX_CPUS = 4096


def parse_size(value: Any) -> int:
    """`"2G"`, `"1.5G"`, `"512M"`, `"64K"`, or bytes as an integer -> bytes. K/M/G/T are
    powers of 1024 (as systemd's MemoryMax= reads them)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as \"512M\" or \"2G\", got {value!r}")
    if isinstance(value, int):
        return value
    if not isinstance(value, str) or (match := _SIZE.fullmatch(value.strip())) is None:
        raise ValueError(f"expected a size such as \"512M\" or \"2G\", got {value!r}")
    number, suffix = match.groups()
    return int(float(number) * 1024 ** _POWERS[suffix.upper()])


def size_text(value: int) -> str:
    """Bytes in the shortest exact form a stack file would use: 67108864 -> "64M"."""
    for suffix in ("T", "G", "M", "K"):
        unit = 1024 ** _POWERS[suffix]
        if value >= unit and value % unit == 0:
            return f"{value // unit}{suffix}"
    for suffix in ("T", "G", "M"):
        unit = 1024 ** _POWERS[suffix]
        if value >= unit:
            return f"{value / unit:.2f}".rstrip("0").rstrip(".") + suffix
    return str(value)


def parse_percent(value: Any) -> float:
    """`"150%"` -> 150.0: a share of one CPU (200% is two CPUs' time)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1])
        except ValueError:
            pass
    raise ValueError(f"expected a percentage of one CPU such as \"150%\", got {value!r}")


def parse_cpu_list(text: str) -> frozenset[int]:
    """`"0-1,4"` -> {0, 1, 4}: the kernel's CPU list format (cpuset.cpus, taskset -c)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise ValueError(f"expected a CPU list such as \"0-1\" or \"0,2-3\", got {text!r}")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low or high >= MAX_CPUS:
            raise ValueError(f"CPU range {part!r} is empty or beyond CPU {MAX_CPUS - 1}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def cpu_list_text(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 4} -> "0-2,4"."""
    out: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0] if ordered else 0
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(out) if ordered else ""


def cpuset(value: Any) -> str:
    """A `cpuset` value checked against the CPUs this process may use -> its canonical text."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a CPU list such as \"0-1\" or \"0,2-3\", got {value!r}")
    cpus = parse_cpu_list(value)
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        missing = cpu_list_text(set(cpus - usable))
        raise ValueError(
            f"CPU {missing} is not among this host's usable CPUs ({cpu_list_text(usable)})"
        )
    return cpu_list_text(cpus)
