"""Hypothesis strategies for hostile stack files, names, templates, variables and CLI
arguments, a small TOML writer for them, and the checks every bad input must pass.

Two kinds of input: `hostile_*` may happen to be valid (a property then accepts exit 0 or
2 and checks the shape of a refusal), `invalid_*` is invalid by construction (each
strategy breaks one documented rule), so a property over it can demand exit status 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from dynamod.core import limits

# --------------------------------------------------------------------------- TOML writer


def _escape(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _escape(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_escape(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def toml_document(tables: dict[str, Any]) -> str:
    """Every top-level key as one line; tables become inline tables."""
    return "".join(f"{_escape(k)} = {toml_value(v)}\n" for k, v in tables.items())


# --------------------------------------------------------------------------- pieces

HOSTILE_STRINGS = [
    "", " ", "{", "}", "{{", "}}", "{}", "{ports}", "{vars}", "{units}", "{index}",
    "{name}", "{vars.nope}", "{units.nope.ports.x}", "{ports.nope}", "{units.a.ports.p}",
    "{vars.a}{vars.a}{vars.a}", "..", "../..", "/", "/dev/zero", "a/b",
    "\n", "é", "名前", "\u202e", "worker@0", "a" * 70, "9" * 30, "-1", "nan", "inf", "1e9",
    "SIGNOPE", "never", "always", "oneshot", "started", "ready", "completed",
]

# NUL is one of the sampled strings; free text leaves it out, or it would be nearly every
# example's first (and only) problem.
_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=24)

hostile_text = st.one_of(
    st.sampled_from(HOSTILE_STRINGS),
    _text,
    st.lists(st.sampled_from(HOSTILE_STRINGS) | _text, max_size=5).map("".join),
)

hostile_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 65535, 65536, 256, 257, 2**31, 2**63, 10**20]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300, 1e300, 86400.5]),
)

# NUL in a string is refused before anything else is looked at: invalid_stack covers it.
hostile_scalar = st.one_of(hostile_text, hostile_number, st.booleans())

hostile_value = st.recursive(
    hostile_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=5,
)

valid_unit_name = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-",
    min_size=1,
    max_size=limits.MAX_NAME_LENGTH,
)

hostile_unit_name = st.one_of(valid_unit_name, st.sampled_from(["a", "b", "etcd"]), hostile_text)

bad_unit_name = st.one_of(
    st.just(""),
    st.text(min_size=1, max_size=20).filter(lambda s: not set(s) <= limits.UNIT_NAME_CHARS),
    st.text(alphabet="ab_-9", min_size=limits.MAX_NAME_LENGTH + 1, max_size=100),
    st.sampled_from(["a/b", "..", "../x", "a.b", "é", "a b", "a\x00", "a@0", "x" * 65]),
)

# what `logs UNIT` / `restart UNIT` must refuse ("a@0" is a bad file name, a good instance)
bad_instance_name = bad_unit_name.filter(lambda n: not limits.is_instance_name(n))

_PROBE_KINDS = ["tcp", "http", "exec", "log", "dynamo_frontend"]
_PROBE_FIELDS = ["interval", "timeout", "deadline", "failure_threshold", "port", "url", "host",
                 "command", "pattern", "expect_status", "expect_json", "namespace", "model",
                 "min_instances", "method"]
_RESTART_FIELDS = ["policy", "first_delay", "backoff_initial", "backoff_max", "backoff_factor",
                   "jitter", "limit_burst", "limit_interval", "reset_after"]


def _table(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    keys = st.one_of(st.sampled_from(fields), st.sampled_from(fields), hostile_text)
    return st.dictionaries(keys, hostile_value, max_size=3)


hostile_probe = st.builds(
    lambda kind, rest: {"kind": kind, **rest},
    st.sampled_from(_PROBE_KINDS) | hostile_text,
    _table(_PROBE_FIELDS),
)

hostile_unit = st.fixed_dictionaries(
    {},
    optional={
        "command": st.lists(hostile_text, max_size=4) | hostile_value,
        "replicas": hostile_number | hostile_text,
        "ports": st.dictionaries(hostile_text, hostile_number | hostile_text, max_size=3),
        "env": st.dictionaries(hostile_text, hostile_text, max_size=3) | hostile_value,
        "depends_on": st.lists(hostile_unit_name, max_size=3)
        | st.dictionaries(hostile_unit_name, hostile_text, max_size=3),
        "type": hostile_text,
        "ready": hostile_probe,
        "live": hostile_probe,
        "restart": _table(_RESTART_FIELDS),
        "stop": _table(["signal", "timeout"]),
        "cwd": hostile_text,
        "description": hostile_value,
        "install_hint": hostile_value,
    },
)

hostile_stack_tables = st.fixed_dictionaries(
    # bad unit names are refused first: invalid_stack covers them; here names are valid
    {"units": st.dictionaries(
        valid_unit_name | st.sampled_from(["a", "b", "etcd"]), hostile_unit, min_size=1, max_size=2
    )},
    optional={
        "vars": st.dictionaries(hostile_text, hostile_value, max_size=3),
        "stack": st.fixed_dictionaries(
            {},
            optional={
                "name": valid_unit_name | hostile_value,
                "include": st.lists(hostile_text, max_size=2),
            },
        ),
        "policy": st.dictionaries(
            st.sampled_from(["store", "etcd", "shards", "keep", "call_timeout"]) | hostile_text,
            hostile_value,
            max_size=3,
        ),
    },
)

# ------------------------------------------------------------- invalid by construction

SENTINEL_NAME = "spawned"


def base_unit(sentinel: Path) -> dict[str, Any]:
    """A unit that would leave `sentinel` behind if it were ever started."""
    return {"command": ["touch", str(sentinel)], "type": "oneshot"}


Breaker = Callable[[dict[str, Any]], dict[str, Any]]

_bad_int = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=limits.MAX_INSTANCES + 1, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["many", "1.5", "", "{vars.nope}", "0x10"]),
    st.booleans(),
)
_bad_port = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=limits.MAX_PORT + 1, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["http", "", "{ports.nope}", "80.5"]),
)
_bad_seconds = st.one_of(
    st.floats(max_value=-1e-9, allow_nan=False),
    st.floats(min_value=limits.MAX_SECONDS * 1.0001, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from(["soon", "", "10s"]),
)
_unknown_key = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(
    lambda k: k
    not in {"command", "replicas", "ports", "env", "depends_on", "type", "ready", "live",
            "restart", "stop", "cwd", "description", "install_hint", "dynamo",
            "name", "unit", "index", "source"}
)


def _set(path: list[str], value: Any) -> Breaker:
    def apply(unit: dict[str, Any]) -> dict[str, Any]:
        node = unit
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        return unit

    return apply


_timeout_paths = st.sampled_from([
    ["stop", "timeout"],
    ["ready", "timeout"],
    ["ready", "interval"],
    ["ready", "deadline"],
    ["restart", "backoff_max"],
    ["restart", "limit_interval"],
])


def _probe_timeout(path: list[str], value: Any) -> Breaker:
    def apply(unit: dict[str, Any]) -> dict[str, Any]:
        if path[0] == "ready":
            unit["ready"] = {"kind": "tcp", "port": 1}
        return _set(path, value)(unit)

    return apply


unit_breakers: st.SearchStrategy[tuple[str, Breaker]] = st.one_of(
    _bad_int.map(lambda v: ("replicas", _set(["replicas"], v))),
    _bad_port.map(lambda v: ("ports.p", _set(["ports"], {"p": v}))),
    st.tuples(_timeout_paths, _bad_seconds).map(
        lambda pv: (".".join(pv[0]), _probe_timeout(pv[0], pv[1]))
    ),
    _unknown_key.map(lambda k: (k, _set([k], 1))),
    st.text(alphabet="abcdefghij_", min_size=1, max_size=10).map(
        lambda v: ("command[1]", _set(["command"], ["touch", "{vars.nope_" + v + "}"]))
    ),
    st.text(min_size=1, max_size=10).map(
        lambda v: ("command[1]", _set(["command"], ["touch", "a\x00" + v]))
    ),
    st.sampled_from(["", "sometimes", "ready", "SIGTERM"]).map(
        lambda v: ("restart.policy", _set(["restart"], {"policy": v}))
    ),
    st.sampled_from(["SIGNOPE", "", "TERMINATE", "42"]).map(
        lambda v: ("stop.signal", _set(["stop"], {"signal": v}))
    ),
    st.sampled_from(["", "A=B", "=x"]).map(lambda k: ("env", _set(["env"], {k: "v"}))),
    st.sampled_from([[], [1], "touch", {"a": 1}]).map(lambda v: ("command", _set(["command"], v))),
)


@dataclass
class Hostile:
    """A stack file (and what else it needs) that must be refused."""

    files: dict[str, bytes]  # name (relative to the sandbox) -> content; "stack.toml" first
    expect: str  # a fragment the refusal must contain (the field, or what is wrong)


def invalid_stack(sentinel: Path) -> st.SearchStrategy[Hostile]:
    """One hostile stack, invalid by construction, whose unit would touch `sentinel`."""

    def unit_case(name_breaker: tuple[str, Breaker]) -> Hostile:
        field, breaker = name_breaker
        tables = {"units": {"a": breaker(base_unit(sentinel))}}
        return Hostile({"stack.toml": toml_document(tables).encode()}, field)

    def bad_name(name: str) -> Hostile:
        tables = {"units": {name: base_unit(sentinel)}}
        return Hostile({"stack.toml": toml_document(tables).encode()}, "unit")

    valid = toml_document({"units": {"a": base_unit(sentinel)}}).encode()

    def not_utf8(pos_junk: tuple[int, bytes]) -> Hostile:
        pos, junk = pos_junk
        pos %= len(valid) + 1
        return Hostile({"stack.toml": valid[:pos] + junk + valid[pos:]}, "UTF-8")

    def too_deep(depth: int) -> Hostile:
        value = "[" * depth + "]" * depth
        text = f'[units.a]\ncommand = ["touch", "{sentinel}"]\nx = {value}\n'
        return Hostile({"stack.toml": text.encode()}, "nested")

    def include(target: str) -> Hostile:
        tables = {"stack": {"include": [target]}, "units": {"a": base_unit(sentinel)}}
        return Hostile({"stack.toml": toml_document(tables).encode()}, "stack.include")

    return st.one_of(
        unit_breakers.map(unit_case),
        bad_unit_name.map(bad_name),
        st.tuples(
            st.integers(min_value=0, max_value=10**6),
            st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80abc", b"\xfe\xff"]),
        ).map(not_utf8),
        st.integers(min_value=limits.MAX_NESTING + 1, max_value=3000).map(too_deep),
        st.sampled_from([".", "/dev/zero", "/dev/null/x", "stack.toml", "nope.toml", "/proc"]).map(
            include
        ),
    )


# --------------------------------------------------------------------------- the checks


def assert_refused(code: int | None, stderr: str, stdout: str, expect: str | None = None) -> None:
    """Exit 2, no traceback, one `dynamod...` line first, each problem on its own line."""
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    assert code == 2, f"exit {code}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    lines = stderr.rstrip("\n").splitlines()
    assert lines and lines[0].startswith("dynamod"), stderr
    assert len(lines) <= limits.MAX_REPORTED_ERRORS + 2, stderr
    if expect is not None:
        assert expect in stderr, f"{expect!r} not in {stderr!r}"


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime: what a command must not change."""
    found: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            found[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return found


def marked_processes(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (anything a CLI run spawned inherits
    it): there must be none after a refused command."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


# --------------------------------------------------------------------------- CLI arguments

_no_equals = st.text(max_size=20).filter(lambda s: "=" not in s)

bad_var = st.one_of(
    _no_equals,
    _no_equals.map(lambda v: "=" + v),
    st.tuples(
        st.text(min_size=1, max_size=10).filter(
            lambda k: "=" not in k and not set(k) <= limits.UNIT_NAME_CHARS
        ),
        st.text(max_size=10),
    ).map(lambda kv: f"{kv[0]}={kv[1]}"),
)

bad_seconds_arg = st.one_of(
    st.sampled_from(["-1", "0", "-0", "nan", "NaN", "inf", "-inf", "1e999", "86401", "", "x",
                     "10s", "1,5", "0x10"]),
    st.floats(max_value=0, allow_nan=False).map(repr),
    st.floats(min_value=limits.MAX_SECONDS * 1.0001, allow_nan=False).map(repr),
)


def _not_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


bad_metrics_addr = st.one_of(
    st.text(max_size=20).filter(lambda s: ":" not in s),
    st.text(max_size=8).filter(_not_float).map(lambda p: f"127.0.0.1:{p}"),
    st.sampled_from(["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", ":", "junk:9464",
                     "999.1.1.1:80", "127.0.0.1:٣", "[::1", "a:b:c"]),
)

bad_count_arg = st.one_of(
    st.integers(max_value=-1).map(str),
    st.integers(min_value=2**64).map(str),
    st.sampled_from(["", "x", "1.5", "1e3", "nan", "--", "0x10"]),
)
