"""Joining a cluster by the head's address (`dynamod up --join ADDR`): the head publishes
its stack as it read it (the stack file, every file it includes, and the variables it was
started with) under `dynamod/<stack>/cluster/spec` in its etcd; a joining node reads that
from the head's etcd, writes the files into its own state dir and starts its share of the
same stack, its node named by `--node` or found as the one of the stack's node addresses
this machine holds. A stack with a secrets directory is not joined this way: its secrets
stay off etcd, so such a node is started from its own copy of the stack and secrets. An
include by an absolute path is read from the joining node's own disk."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dynamod.cluster import registry
from dynamod.core.errors import DynamodError
from dynamod.rollout.etcd import EtcdClient, EtcdError

MAX_FILES = 64
JOIN_TIMEOUT_S = 5.0


class JoinError(DynamodError):
    """The head's etcd had no stack to join, or this node is not one of its nodes."""


@dataclass(frozen=True)
class StackBundle:
    stack: str
    main: str  # the stack file, relative to the bundle's root
    files: dict[str, str]  # relative path -> text
    variables: dict[str, int | str]  # as `--var`: the head's, files' and command line's
    nodes: dict[str, str]  # node name -> address

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> StackBundle:
        data = json.loads(raw)
        return cls(str(data["stack"]), str(data["main"]), dict(data["files"]),
                   dict(data["variables"]), dict(data["nodes"]))  # fmt: skip


def spec_key(stack: str) -> str:
    return f"{registry.prefix(stack)}spec"


def bundle(
    path: Path, stack: str, variables: Mapping[str, Any], nodes: Mapping[str, str]
) -> StackBundle:
    """The stack file and the files it includes or bases itself on by a relative path
    (`[stack] include` and `base`, relative to the naming file), as paths relative to the
    folder they all share. A file named by an absolute path is not carried: the joining
    node reads its own copy."""
    found: dict[Path, str] = {}
    pending = [path.resolve()]
    while pending and len(found) < MAX_FILES:
        file = pending.pop()
        if file in found:
            continue
        text = file.read_text()
        found[file] = text
        header = tomllib.loads(text).get("stack", {})
        named = [*header.get("include", []), *([header["base"]] if "base" in header else [])]
        pending += [
            (file.parent / i).resolve() for i in map(str, named) if not Path(i).is_absolute()
        ]
    root = Path(os.path.commonpath([p.parent for p in found]))
    return StackBundle(
        stack=stack,
        main=str(path.resolve().relative_to(root)),
        files={str(p.relative_to(root)): text for p, text in found.items()},
        variables={k: v for k, v in variables.items() if isinstance(v, int | str)},
        nodes=dict(nodes),
    )


async def fetch(address: str, stack: str | None) -> StackBundle:
    """The bundle the head published in the etcd at `address` (one stack, or `stack`)."""
    async with EtcdClient(address, timeout_s=JOIN_TIMEOUT_S) as etcd:
        try:
            published = [
                kv for kv in await etcd.get_prefix("dynamod/") if kv.key.endswith("/cluster/spec")
            ]
        except EtcdError as exc:
            raise JoinError(f"--join {address}: {exc}") from None
    bundles = [StackBundle.decode(kv.value) for kv in published]
    names = sorted(b.stack for b in bundles)
    chosen = [b for b in bundles if stack is None or b.stack == stack]
    if len(chosen) != 1:
        what = f"no stack {stack!r}" if stack else "not exactly one stack"
        raise JoinError(
            f"--join {address}: {what} published there (published: {', '.join(names) or 'none'}"
            "; a head publishes its stack once its registry is up)"
        )
    return chosen[0]


def unpack(bundle_: StackBundle, into: Path) -> Path:
    """Write the bundle's files under `into`; returns the stack file's path. Refused before
    anything is written: a stack with secrets, or a file that would land outside `into`."""
    main_text = bundle_.files.get(bundle_.main)
    if main_text is None:
        raise JoinError(f"the published stack {bundle_.stack!r} lacks its own file")
    if any(map(_keeps_secrets, bundle_.files.values())):
        raise JoinError(
            f"stack {bundle_.stack!r} keeps its credentials in a secrets directory, which is "
            "never published: start this node from its own copy of the stack and its "
            "secrets (`dynamod up FILE --node NAME`)"
        )
    targets = {relative: (into / relative).resolve() for relative in bundle_.files}
    outside = [r for r, t in targets.items() if not t.is_relative_to(into.resolve())]
    if outside:
        raise JoinError(f"the published stack names a file outside it: {outside[0]!r}")
    for relative, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(bundle_.files[relative])
    return into / bundle_.main


def _keeps_secrets(text: str) -> bool:
    """Whether a published file's `[cluster]` names a secrets directory (the stack file's,
    or its base's); one that is not TOML is refused when the stack is read."""
    try:
        cluster = tomllib.loads(text).get("cluster")
    except tomllib.TOMLDecodeError:
        return False
    return isinstance(cluster, dict) and "secrets" in cluster


def this_node(bundle_: StackBundle) -> str:
    """The node whose address this machine holds (one can bind to it)."""
    mine = [name for name, address in bundle_.nodes.items() if _is_local(address)]
    if len(mine) != 1:
        nodes = ", ".join(f"{n}={a}" for n, a in bundle_.nodes.items())
        held = f"holds the addresses of {', '.join(mine)}" if mine else "holds none of them"
        raise JoinError(f"stack {bundle_.stack!r} has nodes {nodes}; this machine {held}: "
                        "say which with --node")  # fmt: skip
    return mine[0]


def _is_local(address: str) -> bool:
    """Whether `address` is this machine's: the kernel then sends to it from itself (a bind
    test is fooled where `ip_nonlocal_bind` is on)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.closing(socket.socket(family, socket.SOCK_DGRAM)) as probe:
        try:
            probe.connect((address, 9))  # UDP: no packet is sent
        except OSError:
            return False
        return bool(probe.getsockname()[0] == address)
