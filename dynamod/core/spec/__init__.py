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
Every error names the file, the unit and the field. Sizes, counts and durations are
bounded (`core/limits.py`): going past a bound is a SpecError, never a memory exhaustion.
"""

from __future__ import annotations

from dynamod.core.spec.files import RawStack, RawUnit, load_stack
from dynamod.core.spec.models import (
    Condition,
    DynamoFrontendProbe,
    DynamoWorkerSpec,
    ExecProbe,
    HttpProbe,
    HttpUrl,
    HttpUrls,
    LogProbe,
    PolicySpec,
    Probe,
    ProbeBase,
    RestartSpec,
    SpecModel,
    StopSpec,
    TcpProbe,
    UnitSpec,
)
from dynamod.core.spec.resolve import load, resolve_stack
from dynamod.core.spec.stack import PortAllocator, Stack, StackSource
from dynamod.core.spec.vars import parse_var

__all__ = [
    "Condition",
    "DynamoFrontendProbe",
    "DynamoWorkerSpec",
    "ExecProbe",
    "HttpProbe",
    "HttpUrl",
    "HttpUrls",
    "LogProbe",
    "PolicySpec",
    "PortAllocator",
    "Probe",
    "ProbeBase",
    "RawStack",
    "RawUnit",
    "RestartSpec",
    "SpecModel",
    "Stack",
    "StackSource",
    "StopSpec",
    "TcpProbe",
    "UnitSpec",
    "load",
    "load_stack",
    "parse_var",
    "resolve_stack",
]
