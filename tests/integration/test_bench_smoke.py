"""Smoke run of the two cheapest benchmarks (bench/): `--quick --json` exits 0 and prints
the documented result shape. Missed targets are results, not failures, so only the shape
is checked here; docs/benchmarks.md holds the numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def check_shape(result: dict[str, Any], name: str) -> None:
    assert result["benchmark"] == name
    assert result["quick"] is True
    assert isinstance(result["title"], str) and result["title"]
    assert result["machine"]["cores"] >= 1
    assert result["command"].endswith(f"bench.{name} --quick --json")
    assert result["tables"], "a benchmark prints at least one table"
    for table in result["tables"]:
        assert table["title"] and table["headers"]
        assert table["rows"], f"table {table['title']!r} is empty"
        for row in table["rows"]:
            assert len(row) == len(table["headers"]), (table["title"], row)
    assert result["targets"], "every benchmark judges at least one target"
    for target in result["targets"]:
        assert set(target) == {"target", "measured", "limit", "unit", "met"}
        assert isinstance(target["met"], bool)
        assert isinstance(target["measured"], int | float)
        assert math.isfinite(target["measured"]), target


@pytest.mark.parametrize("name", ["detect", "down"])
def test_quick_json(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    check_shape(result, name)
    if name == "detect":
        rows = {row[0]: row for row in result["tables"][0]["rows"]}
        assert any(label.startswith("supervisord") for label in rows)
        floors = [row for label, row in rows.items() if label.startswith("floor")]
        assert len(floors) == 2 and all(row[1] == 10 and 0 < row[2] < 1000 for row in floors)
        assert result["data"]["summary"]["dynamod"]["n"] >= 10
        split = next(t for t in result["tables"] if t["title"].startswith("The same kills"))
        assert len(split["rows"]) == 8
        for key, run in result["data"]["runs"].items():
            # every kill split in two at the reference clock, the parts adding up
            assert len(run["exit_ms"]) == len(run["share_ms"]) == len(run["log_ms"]), key
            for whole, kernel, share in zip(
                run["log_ms"], run["exit_ms"], run["share_ms"], strict=True
            ):
                assert kernel > 0, (key, kernel)  # the exit completes after the kill
                assert math.isclose(kernel + share, whole, abs_tol=1e-6), key
    else:
        survivors = [row for row in result["tables"][0]["rows"] if row[1] == "dynamod"]
        assert survivors and all(row[8] == 0 for row in survivors)
