"""Unit and stack files (TOML) -> typed, validated, fully rendered unit specs.

A stack file lists units directly (`[units.NAME]`) and/or includes unit files
(`[stack] include = [...]`, paths relative to the including file). `[vars]` tables give
template defaults; the stack's vars override included ones and `--var` overrides both.

The package, by job:
  models   the typed unit spec (probes, restart, stop) and the base of every spec table
  files    stack files -> raw tables (includes, vars, shape checks)
  render   templates within the output budget; pydantic errors -> SpecErrors
  resolve  raw -> Stack: expand instances -> assign ports -> render -> link -> order
  links    dependencies;  nodes: a [cluster] stack's placement;  stack: the result
  tables   the registry of tables a layer above the core adds (rollout: [policy], dynamo)
Every error names the file, the unit and the field. Sizes, counts and durations are
bounded (`core/limits.py`): going past a bound is a SpecError, never a memory exhaustion.
"""

from __future__ import annotations

from dynamod.core.spec.files import RawStack, RawUnit, load_stack
from dynamod.core.spec.models import (
    Condition,
    ExecProbe,
    HttpProbe,
    HttpUrl,
    HttpUrls,
    LimitsSpec,
    LogProbe,
    Probe,
    ProbeBase,
    RestartSpec,
    SpecModel,
    StopSpec,
    TcpProbe,
    UnitSpec,
    register_probe,
)
from dynamod.core.spec.resolve import load, resolve_stack
from dynamod.core.spec.stack import PortAllocator, Stack, StackSource
from dynamod.core.spec.tables import (
    StackTable,
    UnitTable,
    register_stack_table,
    register_unit_table,
)
from dynamod.core.spec.vars import Variable, check_overrides, parse_var, variables

__all__ = [
    "Condition",
    "ExecProbe",
    "HttpProbe",
    "HttpUrl",
    "HttpUrls",
    "LimitsSpec",
    "LogProbe",
    "PortAllocator",
    "Probe",
    "ProbeBase",
    "RawStack",
    "RawUnit",
    "RestartSpec",
    "SpecModel",
    "Stack",
    "StackSource",
    "StackTable",
    "StopSpec",
    "TcpProbe",
    "UnitSpec",
    "UnitTable",
    "Variable",
    "check_overrides",
    "load",
    "load_stack",
    "parse_var",
    "register_probe",
    "register_stack_table",
    "register_unit_table",
    "resolve_stack",
    "variables",
]
