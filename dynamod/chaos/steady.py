"""Steady-state probes: what must hold before the method and after the rollbacks. Each
retries until its timeout and answers (ok, what it saw)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from dynamod.chaos.model import Probe
from dynamod.chaos.stack import Stack, served_model
from dynamod.core.errors import DaemonError

_SETTLED = {"ready", "completed"}


def units_ready(stack: Stack) -> tuple[bool, str]:
    units = stack.status()["units"]
    bad = [f"{u['name']}={u['state']}" for u in units if u["state"] not in _SETTLED]
    return (not bad, "all units ready" if not bad else "not ready: " + ", ".join(bad))


def serves(stack: Stack) -> tuple[bool, str]:
    status = stack.status()
    current = (status.get("policy") or {}).get("current")
    name = served_model(status)
    nvext: dict[str, Any] = {"extra_fields": ["engine_data"]}
    if current is not None:
        nvext["routing_constraints"] = {"required_taints": [f"dynamod.policy/{current}"]}
    body = json.dumps({"model": name, "prompt": "steady", "max_tokens": 2, "nvext": nvext})
    request = urllib.request.Request(f"{stack.frontend_url()}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            answer = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"a completion at policy {current} failed: {exc}"
    engine = (answer.get("nvext") or {}).get("engine_data") or {}
    return True, f"served at weight version {engine.get('weight_version')} (current {current})"


def shards_current(stack: Stack) -> tuple[bool, str]:
    status = stack.status()
    current = (status.get("policy") or {}).get("current")
    shards = [u for u in status["units"] if "policy_version" in u]
    off = [f"{u['name']} at {u.get('policy_version')}" for u in shards
           if u.get("policy_version") != current or not (u.get("policy") or {}).get("admitted")]
    if not shards:
        return False, "the stack has no rollout shards"
    return (not off, f"{len(shards)} shards at {current}" if not off
            else f"not at {current} or not admitted: " + ", ".join(off))


PROBES = {"units_ready": units_ready, "serves": serves, "shards_current": shards_current}


def check(stack: Stack, probe: Probe) -> tuple[bool, str]:
    deadline = time.monotonic() + probe.timeout
    seen = "never answered"
    while True:
        try:
            ok, seen = PROBES[probe.kind](stack)
        except DaemonError as exc:
            ok, seen = False, str(exc)
        if ok or time.monotonic() >= deadline:
            return ok, seen
        time.sleep(0.25)
