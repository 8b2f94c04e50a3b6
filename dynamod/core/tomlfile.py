"""Read one stack or unit file into plain tables, refusing anything that is not a small,
UTF-8, sanely nested TOML file.

A directory, a device (`/dev/zero`), a FIFO, a file over the size limit, bytes that are not
UTF-8, nesting deeper than the limit and NUL characters are all SpecErrors naming the file
(and the field where there is one); no OSError, UnicodeDecodeError or RecursionError leaves
this module.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from dynamod.core import limits
from dynamod.core.errors import SpecError, shown

_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def resolve(path: Path, *, referenced_from: Path | None = None, field: str | None = None) -> Path:
    """`path` made absolute with symlinks resolved; a loop or an impossible path is an error
    named where the path came from."""
    where = referenced_from if referenced_from is not None else path
    if "\0" in str(path):
        raise SpecError("path contains a NUL character", file=where, field=field)
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        message = f"cannot resolve path {str(path)!r}: {exc}"
        raise SpecError(message, file=where, field=field) from None


def read(
    path: Path, *, referenced_from: Path | None = None, field: str = "stack.include"
) -> dict[str, Any]:
    """The file's tables. Raises SpecError naming the file; when it cannot be read at all
    and another file names it (`stack.include` or `stack.base`), naming that file's field."""
    try:
        raw = _read_bytes(path)
    except SpecError as exc:
        if referenced_from is None:
            raise
        raise SpecError(
            f"{field.removeprefix('stack.')} {shown(str(path))}: {exc.message}",
            file=referenced_from,
            field=field,
        ) from None
    data = _decode(path, raw)
    try:
        tables = tomllib.loads(data)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"not valid TOML: {exc}", file=path) from None
    except ValueError:  # an integer with more digits than Python converts
        message = "not valid here: an integer with more than 4300 digits"
        raise SpecError(message, file=path) from None
    except RecursionError:
        raise SpecError(
            f"not valid here: nested more than {limits.MAX_NESTING} levels deep", file=path
        ) from None
    check_shape(tables, path)
    return tables


def _read_bytes(path: Path) -> bytes:
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise SpecError("is a directory, expected a TOML file", file=path)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise SpecError(f"is {kind}, expected a TOML file", file=path)
        if info.st_size > limits.MAX_FILE_BYTES:
            raise SpecError(_too_large(info.st_size), file=path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            data = os.read(fd, limits.MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise SpecError("file not found", file=path) from None
    except NotADirectoryError:
        raise SpecError("file not found (a parent of it is not a directory)", file=path) from None
    except PermissionError:
        raise SpecError("cannot read the file: permission denied", file=path) from None
    except OSError as exc:
        raise SpecError(f"cannot read the file: {exc.strerror or exc}", file=path) from None
    if len(data) > limits.MAX_FILE_BYTES:  # it grew between stat and read
        raise SpecError(_too_large(len(data)), file=path)
    return data


def _too_large(size: int) -> str:
    return f"is {size} bytes; stack and unit files may be at most {limits.MAX_FILE_BYTES} bytes"


def _decode(path: Path, data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise SpecError(
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}, column {column} "
            "(TOML files must be UTF-8)",
            file=path,
        ) from None
    return text.removeprefix("\ufeff")


def check_shape(tables: dict[str, Any], path: Path) -> None:
    """No value nested deeper than the limit, no NUL in any key or string. Iterative, so a
    hostile depth cannot exhaust the stack."""
    pending: list[tuple[Any, str, int]] = [(tables, "", 0)]
    while pending:
        value, where, depth = pending.pop()
        if isinstance(value, str):
            if "\0" in value:
                raise SpecError("contains a NUL character", file=path, field=where or None)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > limits.MAX_NESTING:
            raise SpecError(
                f"nested more than {limits.MAX_NESTING} levels deep",
                file=path,
                field=_short(where),
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if "\0" in key:
                    raise SpecError(
                        "a key contains a NUL character", file=path, field=where or None
                    )
                pending.append((item, f"{where}.{key}" if where else key, depth + 1))
        else:
            pending.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _short(where: str) -> str:
    return where if len(where) <= 120 else where[:117] + "..."
