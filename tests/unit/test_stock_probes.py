"""The stock unit files' Dynamo frontends are judged alive by `/live`, never `/health`.

`/health` lists the instances from etcd on every call: with etcd slow (the slow-etcd
runbook), or with the frontend's etcd watch failing over from a lost member (the HA
cluster test: the head's member stopped, completions still served, `/health` silent for
over a second), it misses its 0.5 s and dynamod killed a frontend that was serving."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

UNITS = Path(__file__).resolve().parents[2] / "units"


def frontend_live_paths(doc: dict[str, Any]) -> dict[str, str | None]:
    """Unit name -> the path its liveness probe asks, for units that run dynamo.frontend."""
    found: dict[str, str | None] = {}
    for name, unit in (doc.get("units") or {}).items():
        if not isinstance(unit, dict) or "dynamo.frontend" not in unit.get("command", []):
            continue
        live = unit.get("live")
        found[name] = urlsplit(live["url"]).path if isinstance(live, dict) else None
    return found


def test_every_stock_frontend_is_probed_at_live() -> None:
    seen = {}
    for path in sorted([*UNITS.glob("*.toml"), *UNITS.glob("stacks/*.toml")]):
        for name, probed in frontend_live_paths(tomllib.loads(path.read_text())).items():
            seen[f"{path.relative_to(UNITS)}:{name}"] = probed
    assert {"frontend.toml:frontend", "stacks/cluster.toml:frontend",
            "stacks/cluster-ha.toml:frontend"} <= set(seen), seen  # fmt: skip
    assert {where: p for where, p in seen.items() if p != "/live"} == {}


def test_the_check_sees_a_frontend_probed_at_health() -> None:
    doc = tomllib.loads(
        '[units.fe]\ncommand = ["python", "-m", "dynamo.frontend"]\n'
        'live = { kind = "http", url = "http://127.0.0.1:{ports.http}/health" }\n'
        '[units.other]\ncommand = ["sleep", "1"]\n'
    )
    assert frontend_live_paths(doc) == {"fe": "/health"}
