"""Stack files on disk -> raw tables: a stack file and everything it includes, checked for
shape (known top-level tables, unit names, include cycles and bounds) but not rendered or
validated yet. The stack's `[vars]` override included files' vars and `--var` overrides
both.

A stack file may name another stack file as its base (`[stack] base`): the stack is then
the base (its vars, `[cluster]` and other root tables, includes and units) with this file
on top: its vars override the base's, a root table it has replaces the base's whole table,
and its includes and units are added (a unit name both define is refused, as for an
include). Its name and id are its own, not the base's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamod.core import limits, tomlfile
from dynamod.core.errors import SpecError
from dynamod.core.spec import varformats


@dataclass
class RawUnit:
    name: str
    source: Path
    table: dict[str, Any]


@dataclass
class RawStack:
    path: Path
    name: str
    units: dict[str, RawUnit] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)  # defaults, then --var on top
    defaults: dict[str, Any] = field(default_factory=dict)  # as the files declare them
    formats: dict[str, str] = field(default_factory=dict)  # `[var_formats]`: var -> format
    cluster: dict[str, Any] | None = None
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # registered tables
    files_read: int = 0
    id: str | None = None  # `[stack] id`: the stack's identity in a shared etcd (see below)
    max_starting: int | None = None  # `[stack] max_starting`: starts at once (core/slots)

    def overrides(self) -> dict[str, Any]:
        """The `--var` values the stack was read with (those that differ from the files')."""
        return {
            k: v for k, v in self.vars.items() if k not in self.defaults or self.defaults[k] != v
        }


_STACK_KEYS = ["stack", "vars", "var_formats", "units", "cluster"]
_STACK_TABLE_KEYS = {"name", "id", "include", "description", "max_starting", "base"}
# Every stack has this variable: its identity in an etcd it shares (dynamod's keys live
# under `dynamod/<stack_id>/`, and the stock units' Dynamo namespace is it). Its default is
# `[stack] id`, else the stack's name ('.' made '-': a Dynamo namespace has no dots);
# `--var stack_id=NAME` runs a second copy of a stack beside the first.
STACK_ID_VAR = "stack_id"
# tables a layer above the core registered (`tables.register_stack_table`); like
# [cluster], only the stack file itself may have one, not a file it includes
_REGISTERED: list[str] = []


def register_stack_key(key: str) -> None:
    if key in _STACK_KEYS:
        raise ValueError(f"stack table {key!r} is core's")
    if key not in _REGISTERED:
        _REGISTERED.append(key)


def load_stack(path: Path, var_overrides: Mapping[str, Any] | None = None) -> RawStack:
    """Read a stack file and everything it includes. No rendering, no validation yet."""
    path = tomlfile.resolve(path)
    stack = RawStack(path=path, name=path.stem)
    included_vars: dict[str, Any] = {}
    _load_file(path, stack, included_vars, chain=[], based=[])
    builtin = {STACK_ID_VAR: stack.id or default_id(stack.name)}
    stack.defaults = {**builtin, **included_vars, **stack.vars}
    stack.vars = {**stack.defaults, **(var_overrides or {})}
    return stack


def _load_file(
    path: Path,
    stack: RawStack,
    included_vars: dict[str, Any],
    chain: list[Path],
    based: list[Path],
) -> None:
    """One file: its base first (a stack file's), then its header, vars and root-only
    tables, then its includes (depth first), then its own units, so an included file's
    units come before the includer's. `chain`: the files that include this one; `based`:
    the stack files whose base this one is."""
    _enter(path, stack, chain, based)
    if chain:
        data = tomlfile.read(path, referenced_from=chain[-1], field="stack.include")
    else:
        data = tomlfile.read(path, referenced_from=based[-1] if based else None, field="stack.base")
    is_root = not chain
    header = _header(data, path)
    if "base" in header:
        if not is_root:
            raise SpecError(
                "only a stack file may have a base (an included file adds to one)",
                file=path,
                field="stack.base",
            )
        _load_file(_base(header, path), stack, included_vars, [], [*based, path])
    if is_root and not based and "name" in header:
        stack.name = _stack_name(header["name"], path)
    if is_root and not based and "id" in header:
        stack.id = check_id(header["id"], path, "stack.id")
    if "max_starting" in header:
        if not is_root:
            raise SpecError(
                "only the stack file itself may set it (it is the node's, not a part's)",
                file=path,
                field="stack.max_starting",
            )
        stack.max_starting = check_max_starting(header["max_starting"], path)
    _take_vars(data, path, stack, included_vars, is_root=is_root)
    if "cluster" in data:
        stack.cluster = _root_table(data, "cluster", path, is_root=is_root)
    for key in _REGISTERED:
        if key in data:
            stack.tables[key] = _root_table(data, key, path, is_root=is_root)
    for target in _includes(header, path):
        _load_file(target, stack, included_vars, [*chain, path], based)
    _take_units(data, path, stack)


def _enter(path: Path, stack: RawStack, chain: list[Path], based: list[Path]) -> None:
    """Refuse an include or base cycle, includes or bases nested too deep, or too many
    files in all."""
    _refuse_loop(path, based, "base")
    _refuse_loop(path, chain, "include")
    stack.files_read += 1
    if stack.files_read > limits.MAX_FILES:
        raise SpecError(
            f"the stack reads more than {limits.MAX_FILES} files (with its includes)",
            file=chain[-1] if chain else path,
            field="stack.include",
        )


def _refuse_loop(path: Path, naming: list[Path], what: str) -> None:
    """`naming`: the files that named `path`, by `[stack] include` or `base` (`what`)."""
    if path in naming:
        cycle = " -> ".join(str(p) for p in [*naming, path])
        raise SpecError(f"{what} cycle: {cycle}", file=naming[-1], field=f"stack.{what}")
    if len(naming) > limits.MAX_INCLUDE_DEPTH:
        raise SpecError(
            f"{what}s nest more than {limits.MAX_INCLUDE_DEPTH} levels deep",
            file=naming[-1],
            field=f"stack.{what}",
        )


def _header(data: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The known top-level tables, and the `[stack]` table's keys."""
    known = [*_STACK_KEYS, *_REGISTERED]
    for key in data:
        if key not in known:
            raise SpecError(
                f"unknown top-level table {key!r} (expected one of: {', '.join(known)})",
                file=path,
                field=key,
            )
    header = data.get("stack", {})
    if not isinstance(header, dict):
        raise SpecError("must be a table", file=path, field="stack")
    for key in header:
        if key not in _STACK_TABLE_KEYS:
            raise SpecError(f"unknown key {key!r}", file=path, field=f"stack.{key}")
    return header


def _take_vars(
    data: Mapping[str, Any],
    path: Path,
    stack: RawStack,
    included_vars: dict[str, Any],
    *,
    is_root: bool,
) -> None:
    """The stack file's vars are the stack's; an included file's fill in what is unset
    (the first include to set one wins). So do their `[var_formats]`."""
    file_vars = data.get("vars", {})
    if not isinstance(file_vars, dict):
        raise SpecError("must be a table", file=path, field="vars")
    formats = data.get("var_formats", {})
    if not isinstance(formats, dict):
        raise SpecError("must be a table", file=path, field="var_formats")
    varformats.check_declared(formats, file_vars, path)
    if is_root:  # a base's first, then the stack file's over them
        stack.vars.update(file_vars)
        stack.formats.update(formats)
    else:
        for key, value in file_vars.items():
            included_vars.setdefault(key, value)
        for key, format_name in formats.items():
            stack.formats.setdefault(key, format_name)


def _root_table(data: Mapping[str, Any], key: str, path: Path, *, is_root: bool) -> dict[str, Any]:
    if not is_root:
        raise SpecError(
            f"only the stack file itself may have a [{key}] table", file=path, field=key
        )
    table = data[key]
    if not isinstance(table, dict):
        raise SpecError("must be a table", file=path, field=key)
    return table


def _base(header: Mapping[str, Any], path: Path) -> Path:
    base = header["base"]
    if not isinstance(base, str) or not base:
        raise SpecError("must be a stack file's path", file=path, field="stack.base")
    return tomlfile.resolve(path.parent / base, referenced_from=path, field="stack.base")


def _includes(header: Mapping[str, Any], path: Path) -> list[Path]:
    includes = header.get("include", [])
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise SpecError("must be a list of file paths", file=path, field="stack.include")
    return [
        tomlfile.resolve(path.parent / include, referenced_from=path, field="stack.include")
        for include in includes
    ]


def _take_units(data: Mapping[str, Any], path: Path, stack: RawStack) -> None:
    units = data.get("units", {})
    if not isinstance(units, dict):
        raise SpecError("must be a table of units", file=path, field="units")
    for name, table in units.items():
        _check_unit_name(name, path)
        if not isinstance(table, dict):
            raise SpecError("must be a table", file=path, unit=name)
        if name in stack.units:
            other = stack.units[name].source
            if other == path:  # one file reached through two includes: one copy of it
                continue
            raise SpecError(f"unit is also defined in {other}", file=path, unit=name)
        stack.units[name] = RawUnit(name=name, source=path, table=table)
        if len(stack.units) > limits.MAX_INSTANCES:
            raise SpecError(
                f"more than {limits.MAX_INSTANCES} units in the stack", file=path, unit=name
            )


def _check_unit_name(name: str, path: Path) -> None:
    if not name or not set(name) <= limits.UNIT_NAME_CHARS:
        raise SpecError(
            "unit names may use letters, digits, '_' and '-' only", file=path, unit=name
        )
    if len(name) > limits.MAX_NAME_LENGTH:
        raise SpecError(
            f"unit names may be at most {limits.MAX_NAME_LENGTH} characters long",
            file=path,
            unit=name,
        )


def _stack_name(value: Any, path: Path) -> str:
    """It names systemd services and supervisord groups: the unit-name alphabet plus '.'."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > limits.MAX_NAME_LENGTH
        or not set(value) <= limits.UNIT_NAME_CHARS | {"."}
    ):
        raise SpecError(
            f"must be a name of at most {limits.MAX_NAME_LENGTH} letters, digits, '_', '-' "
            f"or '.', got {value!r}",
            file=path,
            field="stack.name",
        )
    return value


def default_id(name: str) -> str:
    """A stack's identity when nothing names one: its name, '.' made '-'."""
    return name.replace(".", "-")


def check_max_starting(value: Any, path: Path) -> int:
    """How many units may be starting at once: a whole number, 1 up to the stack's limit
    on instances (a larger one limits nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
        1 <= value <= limits.MAX_INSTANCES
    ):
        raise SpecError(
            f"must be a whole number from 1 to {limits.MAX_INSTANCES} (units starting at "
            f"once; leave it out for no limit), got {value!r}",
            file=path,
            field="stack.max_starting",
        )
    return value


def check_id(value: Any, path: Path, where: str) -> str:
    """A stack identity: an etcd key segment and a Dynamo namespace, so the unit-name
    alphabet (no '.', no '/')."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `--var stack_id=2` arrives as an int
    if (
        not isinstance(value, str)
        or not value
        or len(value) > limits.MAX_NAME_LENGTH
        or not set(value) <= limits.UNIT_NAME_CHARS
    ):
        raise SpecError(
            f"a stack identity is at most {limits.MAX_NAME_LENGTH} letters, digits, '_' or "
            f"'-', got {value!r}",
            file=path,
            field=where,
        )
    return value
