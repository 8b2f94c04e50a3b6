"""What changes between two resolved stacks: the running one and the one `apply` (or `scale`)
would make of it. Pure: two `Stack`s in, a `StackDiff` out, printed for people (`lines`)
or as JSON (`as_json`).

  added / removed   instances (`worker@2`) that only one side has
  changed           instance -> the fields of its spec that differ (command, env, ports, ready,
                    ...): restarted with the new spec if one is a RESTART_FIELD, else the
                    new spec is taken in place
  replicas          base unit -> (old count, new count), where the count differs
  vars              variable -> (old, new) (None: the side that does not have it)
  tables            stack table (`policy`; `stack` for `[stack] max_starting`) -> field ->
                    (old, new)

Fields that never reach the process (description, install_hint, the file a unit came from)
are not changes: editing a comment-like field restarts nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamod.core.spec.models import SpecModel, UnitSpec
from dynamod.core.spec.stack import Stack

_IGNORED = frozenset({"name", "index", "source", "description", "install_hint"})
# What the process itself is started with: a change restarts the unit. The rest (its
# dependencies, probes, restart and stop settings, tables) is dynamod's own business and
# changes in place, taking effect where it is next used (a probe: at the next start).
RESTART_FIELDS = frozenset(
    {"command", "env", "cwd", "ports", "type", "remote", "outside", "limits"}
)
_SHOWN = 60  # characters of one value in a line


@dataclass(frozen=True)
class StackDiff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, list[str]] = field(default_factory=dict)
    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)
    vars: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    tables: dict[str, dict[str, tuple[Any, Any]]] = field(default_factory=dict)

    def restarted(self) -> list[str]:
        """The changed instances that a change restarts (in the order they changed)."""
        return [n for n, fields in self.changed.items() if RESTART_FIELDS.intersection(fields)]

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.vars or self.tables)

    def as_json(self) -> dict[str, Any]:
        return {
            "empty": self.empty,
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": {name: list(fields) for name, fields in self.changed.items()},
            "replicas": {name: list(counts) for name, counts in self.replicas.items()},
            "vars": {name: list(values) for name, values in self.vars.items()},
            "tables": {
                key: {name: list(values) for name, values in fields.items()}
                for key, fields in self.tables.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StackDiff:
        """The diff `as_json` wrote (as the daemon answers it to the CLI)."""
        return cls(
            added=list(data.get("added", [])),
            removed=list(data.get("removed", [])),
            changed={k: list(v) for k, v in data.get("changed", {}).items()},
            replicas={k: (v[0], v[1]) for k, v in data.get("replicas", {}).items()},
            vars={k: (v[0], v[1]) for k, v in data.get("vars", {}).items()},
            tables={
                key: {k: (v[0], v[1]) for k, v in fields.items()}
                for key, fields in data.get("tables", {}).items()
            },
        )


def diff(old: Stack, new: Stack) -> StackDiff:
    """What turning `old` into `new` changes."""
    changed = {
        name: differ
        for name in new.order
        if name in old.units and (differ := unit_fields(old.units[name], new.units[name]))
    }
    old_vars = old.source.raw.vars if old.source else {}
    new_vars = new.source.raw.vars if new.source else {}
    return StackDiff(
        added=[name for name in new.order if name not in old.units],
        removed=[name for name in old.order if name not in new.units],
        changed=changed,
        replicas=_replicas(old, new),
        vars=_changed_values(old_vars, new_vars),
        tables=_stack_settings(old, new) | {
            key: fields
            for key in sorted({*old.tables, *new.tables})
            if (fields := _table_fields(old.tables.get(key), new.tables.get(key)))
        },
    )


def _stack_settings(old: Stack, new: Stack) -> dict[str, dict[str, tuple[Any, Any]]]:
    """The `[stack]` table's settings that act on a running stack (changed in place)."""
    if old.max_starting == new.max_starting:
        return {}
    return {"stack": {"max_starting": (old.max_starting, new.max_starting)}}


def unit_fields(old: UnitSpec, new: UnitSpec) -> list[str]:
    """The fields of a unit's spec that differ (a registered table by its key)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    tables_a, tables_b = a.pop("tables", {}), b.pop("tables", {})
    fields = [k for k in a if k not in _IGNORED and a[k] != b.get(k)]
    fields += sorted(k for k in {*tables_a, *tables_b} if tables_a.get(k) != tables_b.get(k))
    return fields


def _replicas(old: Stack, new: Stack) -> dict[str, tuple[int, int]]:
    def counts(stack: Stack) -> dict[str, int]:
        found: dict[str, int] = {}
        for spec in stack.units.values():
            found[spec.unit] = found.get(spec.unit, 0) + 1
        return found

    before, after = counts(old), counts(new)
    return {
        unit: (before.get(unit, 0), after.get(unit, 0))
        for unit in sorted({*before, *after})
        if before.get(unit, 0) != after.get(unit, 0)
    }


def _changed_values(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        key: (old.get(key), new.get(key))
        for key in sorted({*old, *new})
        if old.get(key) != new.get(key) or (key in old) != (key in new)
    }


def _table_fields(old: SpecModel | None, new: SpecModel | None) -> dict[str, tuple[Any, Any]]:
    a = old.model_dump(mode="json") if old is not None else {}
    b = new.model_dump(mode="json") if new is not None else {}
    if (old is None) != (new is None):  # the whole table comes or goes
        return {"(table)": ("absent" if old is None else "present",
                            "absent" if new is None else "present")}  # fmt: skip
    return _changed_values(a, b)


# ---------------------------------------------------------------------- for people


def lines(change: StackDiff, bases: Mapping[str, str]) -> list[str]:
    """The diff as short lines: `+`/`-` units and replicas, `~` changed fields, vars and
    tables. `bases`: instance -> base unit name, of both stacks (to group replicas)."""
    if change.empty:
        return ["no change"]
    out: list[str] = []
    grouped_added = _by_base(change.added, bases)
    grouped_removed = _by_base(change.removed, bases)
    for unit in sorted({*grouped_added, *grouped_removed}):
        counts = change.replicas.get(unit)
        plus, minus = grouped_added.get(unit, []), grouped_removed.get(unit, [])
        if counts is not None and counts[0] == 0:
            out.append(f"+ unit {unit}" + _instances(plus))
        elif counts is not None and counts[1] == 0:
            out.append(f"- unit {unit}" + _instances(minus))
        else:
            what = f"replicas {counts[0]} -> {counts[1]}" if counts else "instances"
            moves = [f"+{n}" for n in plus] + [f"-{n}" for n in minus]
            out.append(f"~ {unit}: {what} ({', '.join(moves)})")
    for differ, names in _group_changed(change.changed).items():
        how = "restarted" if RESTART_FIELDS.intersection(differ) else "in place, no restart"
        out.append(f"~ {', '.join(names)}: {', '.join(differ)} changed ({how})")
    for name, (old, new) in change.vars.items():
        out.append(f"~ var {name}: {_shown(old)} -> {_shown(new)}")
    for key, fields in change.tables.items():
        for name, (old, new) in fields.items():
            out.append(f"~ [{key}] {name}: {_shown(old)} -> {_shown(new)}")
    return out


def _by_base(names: list[str], bases: Mapping[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(bases.get(name, name.partition("@")[0]), []).append(name)
    return grouped


def _instances(names: list[str]) -> str:
    return f" ({', '.join(names)})" if len(names) > 1 or "@" in "".join(names) else ""


def _group_changed(changed: Mapping[str, list[str]]) -> dict[tuple[str, ...], list[str]]:
    """Instances with the same changed fields on one line."""
    grouped: dict[tuple[str, ...], list[str]] = {}
    for name, fields in changed.items():
        grouped.setdefault(tuple(fields), []).append(name)
    return grouped


def _shown(value: Any) -> str:
    text = "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
