"""Export a stack to another process manager. Pure text generation, plus the few facts
every export needs: absolute executables, the PATH units see, and what gets lost.

supervisord (`supervisord_config`) runs the same commands with the same environment, in
dependency order by priority, and stops each unit's process group (a unit's replicas
together, as one supervisord group). It cannot express readiness gating, liveness probes,
the rejoin protocol or the tree sweep; `supervisord_gaps` says so in words, for the file
header and for stderr.

Ports are allocated when the stack is loaded, so an exported file carries fixed ports.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from dynamod.core import graph, process
from dynamod.core.errors import DynamodError
from dynamod.core.spec import Condition, Stack, UnitSpec


class ExportError(DynamodError):
    """The stack uses something the target format cannot carry (names the unit)."""


# --------------------------------------------------------------------------- shared


def bin_dir() -> Path:
    """dynamod's own bin dir (a venv's): dynamod puts it first on every unit's PATH, so
    binaries installed beside it (etcd, nats-server) are found."""
    return Path(sys.executable).parent


def resolve_command(spec: UnitSpec) -> list[str]:
    """The unit's command with its executable made absolute (service managers need that),
    looked up the way dynamod's preflight does."""
    exe = spec.command[0]
    path = process.base_environment("export", spec.name, spec.env)["PATH"]
    found = exe if "/" in exe else shutil.which(exe, path=path)
    if found is None:
        hint = f"; {spec.install_hint}" if spec.install_hint else ""
        raise ExportError(
            f"{spec.source}: unit {spec.name!r}: command {exe!r} is not installed "
            f"(not found on PATH){hint}. Export on the machine that will run the stack."
        )
    return [str(Path(found).absolute()), *spec.command[1:]]


def _start_levels(stack: Stack) -> dict[str, int]:
    """Instance -> start wave (0 = no dependencies)."""
    edges = {name: list(spec.depends_on) for name, spec in stack.units.items()}
    return {name: i for i, wave in enumerate(graph.levels(edges)) for name in wave}


def _names(units: Sequence[UnitSpec]) -> str:
    return ", ".join(u.name for u in units)


# --------------------------------------------------------------------------- supervisord

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INLINE_COMMENT = re.compile(r"\s[;#]")  # supervisord's parser cuts a value there
_SHLEX_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")
_PRIORITY_BASE, _PRIORITY_STEP = 100, 10
_SOCKET_MAX = 107  # sun_path is 108 bytes including the NUL


def program_name(instance: str) -> str:
    """supervisord program names cannot contain '@': worker@0 -> worker-0."""
    return instance.replace("@", "-")


def group_of(instance: str) -> str | None:
    """The supervisord group a replica's program is in (its unit: worker@0 -> worker);
    None for a single unit, which is a group of its own."""
    base, at, _ = instance.partition("@")
    return base if at else None


def supervisorctl_name(instance: str) -> str:
    """The name supervisorctl and the XML-RPC interface take for an instance: a replica is
    in its unit's group (worker@0 -> worker:worker-0), a single unit is its own (etcd)."""
    group = group_of(instance)
    return f"{group}:{program_name(instance)}" if group else instance


def _ini(value: str, what: str) -> str:
    """A value for supervisord's config parser: '%' doubled (it expands %(name)s), no
    newline, and no whitespace followed by ';' or '#' (an inline comment to it)."""
    if "\n" in value or _INLINE_COMMENT.search(value):
        raise ExportError(
            f"{what} {value!r} cannot be written to a supervisord config "
            "(its parser cuts values at newlines and at ' ;' / ' #')"
        )
    return value.replace("%", "%%")


def _comment(text: str) -> str:
    return " ".join(text.split())


def supervisord_command(argv: Sequence[str]) -> str:
    """`command=` is split with shlex (POSIX). Unsafe characters are backslash-escaped
    rather than quoted, so no whitespace is ever followed by ';' or '#'."""
    words = []
    for arg in argv:
        if not arg:
            words.append("''")
        elif _SHLEX_SAFE.match(arg):
            words.append(arg)
        else:
            words.append("".join(c if _SHLEX_SAFE.match(c) else "\\" + c for c in arg))
    return " ".join(words)


def supervisord_environment(spec: UnitSpec) -> str:
    """`environment=KEY="value",...` for one program, ready for the config file.

    PATH is dynamod's bin dir in front of supervisord's own PATH (unless the unit sets
    PATH), as under dynamod. Values are parsed by a non-POSIX shlex that keeps the quotes
    and then strips quote characters from both ends, so a value may contain one kind of
    quote but must not start or end with one."""
    where = f"unit {spec.name!r}: environment"
    pairs = [] if "PATH" in spec.env else [f'PATH="{_ini(str(bin_dir()), where)}:%(ENV_PATH)s"']
    for key, value in spec.env.items():
        if not ENV_NAME.match(key):
            raise ExportError(f"{where}: {key!r} is not a valid variable name")
        if value[:1] in {"'", '"'} or value[-1:] in {"'", '"'} or ('"' in value and "'" in value):
            raise ExportError(
                f"{where}: {key}={value!r} cannot be expressed in supervisord's environment= "
                "syntax (a quote at either end, or both kinds of quote)"
            )
        quote = "'" if '"' in value else '"'
        pairs.append(f"{key}={quote}{_ini(value, where)}{quote}")
    return ",".join(pairs)


def _autorestart(spec: UnitSpec) -> str:
    return {"always": "true", "on-failure": "unexpected", "never": "false"}[spec.restart.policy]


def supervisord_config(stack: Stack, *, state_dir: Path) -> str:
    """The whole supervisord config: daemon sections, one [program:x] per instance and
    one [group:unit] per replicated unit.
    supervisord's socket, pid file and log go in `state_dir`, unit logs in `state_dir/logs`
    (where `dynamod logs` looks)."""
    names: dict[str, str] = {}
    for instance in stack.order:
        if stack.units[instance].outside is not None:
            continue  # it runs outside the stack (`outside = HOST:PORT`): not ours to start
        name = program_name(instance)
        if name in names:
            raise ExportError(
                f"units {names[name]!r} and {instance!r} both map to supervisord program {name!r}"
            )
        names[name] = instance
    base = _ini(str(state_dir.absolute()), "state dir")
    socket = f"{base}/supervisord.sock"
    if len(socket.encode()) > _SOCKET_MAX:
        raise ExportError(
            f"socket path {socket} is too long for a unix socket; pick a shorter --state-dir"
        )
    levels = _start_levels(stack)
    lines = [
        f"; supervisord config for dynamod stack {stack.name!r}, generated from",
        f"; {_comment(str(stack.path))} by `dynamod export supervisord`.",
        "; Ports were allocated at export time and are fixed below: export again, do not edit.",
        f"; Before starting: mkdir -p {base}/logs",
        ";",
        "; What supervisord cannot do that dynamod does:",
        *[f";   - {gap}" for gap in supervisord_gaps(stack)],
        "",
        "[unix_http_server]",
        f"file={socket}",
        "chmod=0700",
        "",
        "[supervisord]",
        "nodaemon=true",
        f"pidfile={base}/supervisord.pid",
        f"logfile={base}/supervisord.log",
        f"childlogdir={base}/logs",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{socket}",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
    ]
    groups: dict[str, list[str]] = {}  # a replicated unit -> its programs' instances
    for name, instance in names.items():
        lines += ["", *_program(stack.units[instance], name, levels[instance], base)]
        if (group := group_of(instance)) is not None:
            groups.setdefault(group, []).append(instance)
    for unit, instances in groups.items():
        programs = [program_name(i) for i in instances]
        lines += ["", *_group(unit, programs, levels[instances[0]])]
    return "\n".join(lines) + "\n"


def _group(unit: str, programs: list[str], level: int) -> list[str]:
    """A replicated unit's programs as one group. supervisord stops one group per pass of
    its main loop (about a second each) when it shuts down, so replicas left as groups of
    their own took ~35 s to stop 64 of them; a group's programs are stopped together."""
    return [
        f"; {unit}'s replicas, stopped together; supervisorctl names them {unit}:{programs[0]} "
        f"and so on ({unit}:* for all)",
        f"[group:{unit}]",
        f"programs={','.join(programs)}",
        f"priority={_PRIORITY_BASE + _PRIORITY_STEP * level}",
    ]


def _program(spec: UnitSpec, name: str, level: int, base: str) -> list[str]:
    where = f"unit {spec.name!r}:"
    lines = [
        f"; {spec.name}: {_comment(spec.description)}" if spec.description else f"; {spec.name}"
    ]
    if spec.depends_on:
        after = ", ".join(f"{dep} ({cond})" for dep, cond in spec.depends_on.items())
        # (a dependency outside the stack has no program here: supervisord never waits
        # for it, only its priority wave orders the rest)
        lines.append(f"; dynamod starts it after: {after}")
    command = supervisord_command(resolve_command(spec))
    lines += [f"[program:{name}]", f"command={_ini(command, f'{where} command')}"]
    if spec.cwd:
        lines.append(f"directory={_ini(spec.cwd, f'{where} cwd')}")
    lines += [
        f"environment={supervisord_environment(spec)}",
        # lower starts first and stops last: one step per dependency wave
        f"priority={_PRIORITY_BASE + _PRIORITY_STEP * level}",
        "autostart=true",
        f"autorestart={_autorestart(spec)}",
        "exitcodes=0",
        # dynamod forgets a unit's backoff once it stayed up reset_after seconds; in
        # supervisord an exit before startsecs counts toward startretries (then FATAL)
        f"startsecs={0 if spec.type == 'oneshot' else math.ceil(spec.restart.reset_after)}",
        f"startretries={spec.restart.limit_burst}",
        f"stopsignal={spec.stop.signal.removeprefix('SIG')}",
        f"stopwaitsecs={math.ceil(spec.stop.timeout)}",
        "stopasgroup=true",
        "killasgroup=true",
        "redirect_stderr=true",
        f"stdout_logfile={base}/logs/{spec.name}.log",
        "stdout_logfile_maxbytes=20MB",
        "stdout_logfile_backups=3",
    ]
    return lines


def lease_note(workers: Sequence[UnitSpec]) -> str:
    """How long a dead worker that nothing revokes stays routable: its Dynamo lease."""
    ttls = sorted({u.env["ETCD_LEASE_TTL"] for u in workers if "ETCD_LEASE_TTL" in u.env})
    if not ttls:
        return ""
    return (f"; one that dies stays routable until its Dynamo lease runs out (ETCD_LEASE_TTL "
            f"{'/'.join(ttls)} s; --var dynamo_lease_ttl=30 shortens it)")


def supervisord_gaps(stack: Stack) -> list[str]:
    """What the exported config does not do, in words an operator can act on."""
    units = list(stack.units.values())
    gated = [u for u in units if any(c is not Condition.STARTED for c in u.depends_on.values())]
    probed = [u for u in units if u.ready is not None]
    live = [u for u in units if u.live is not None]
    workers = [u for u in units if "dynamo" in u.tables]
    gaps = [
        "readiness gating: programs start in priority order without waiting for readiness "
        + (f"probes (these have one: {_names(probed)})" if probed else "probes")
        + "; a dependent may start before what it needs answers",
        "dependency conditions: 'ready' and 'completed' are not expressible"
        + (f" (used by: {_names(gated)})" if gated else "")
        + "; priorities only order starts and stops",
        "liveness probes: supervisord only notices exits"
        + (f"; a hung {_names(live)} is not restarted" if live else ""),
        "rejoin / lease revocation: a restarted rollout shard takes traffic without policy "
        "replay, and a dead worker's etcd lease is not revoked"
        + (f" (Dynamo workers: {_names(workers)})" if workers else "")
        + lease_note(workers),
        "process tree sweep: stopasgroup/killasgroup signal the process group only; "
        "descendants that left it survive, and nothing is killed if supervisord is SIGKILLed",
        "restart limits: supervisord retries failed starts with a linear delay, not "
        "exponential backoff with jitter, and restarts a program that ran past startsecs "
        "without any limit",
    ]
    limited = [u for u in units if u.limits is not None and u.limits.words()]
    if limited:
        gaps.append(
            "limits: supervisord sets no memory, CPU, priority or process limits "
            f"({_names(limited)} have them); run them under systemd "
            "(`dynamod systemd generate --per-unit`) or dynamod"
        )
    return gaps
