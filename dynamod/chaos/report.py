"""`dynamod chaos report DIR`: an index page of the last runs under DIR, newest first, each
with its verdict, its failed checks and its timeline picture."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any


def runs(folder: Path, last: int = 50) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in folder.glob("*/journal.json"):
        try:
            found.append((path.parent, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    found.sort(key=lambda item: str(item[1].get("start", "")), reverse=True)
    return found[:last]


def write_index(folder: Path, last: int = 50) -> Path:
    rows = []
    for run_dir, j in runs(folder, last):
        name = html.escape(j["experiment"]["name"])
        passed = j.get("passed")
        colour = "#2e7d32" if passed else "#c62828"
        failed = "<br>".join(html.escape(f"{c['check']}: {c['detail']}")
                             for c in j.get("checks", []) if not c["ok"])
        picture = run_dir / "timeline.png"
        img = (f'<a href="{run_dir.name}/timeline.png"><img src="{run_dir.name}/timeline.png" '
               'width="480"></a>' if picture.exists() else "(no picture)")
        rows.append(
            f"<tr><td><a href='{run_dir.name}/journal.json'>{name}</a><br>"
            f"{html.escape(j['start'])}<br>{html.escape(j.get('profile', ''))} profile, "
            f"{j['duration']:.0f}s</td><td style='color:{colour}'><b>"
            f"{html.escape(j.get('verdict', ''))}</b><br>status {html.escape(j['status'])}"
            f"{', deviated' if j['deviated'] else ''}<br>{failed}</td><td>{img}</td></tr>")
    page = ("<!doctype html><meta charset='utf-8'><title>dynamod chaos runs</title>"
            "<style>body{font-family:sans-serif}td{vertical-align:top;padding:6px;"
            "border-bottom:1px solid #ddd}</style><h1>dynamod chaos runs</h1>"
            f"<table><tr><th>runbook</th><th>verdict</th><th>timeline</th></tr>{''.join(rows)}"
            "</table>\n")
    index = folder / "index.html"
    index.write_text(page)
    return index
