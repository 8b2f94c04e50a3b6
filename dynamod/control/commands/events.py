"""`dynamod events`: what happened to the stack (state changes with their reasons,
restarts with their delays, phase changes, pushes, promotions, revocations), read from the
state dir's events file, so it works during a run and after the daemon has gone."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import click

from dynamod.control.cliutil import BAD_INPUT, fail, state_dir_of
from dynamod.core import events as ev


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return ev.parse_since(value, now=time.time())
    except ev.BadSince as exc:
        fail(str(exc), BAD_INPUT)
        raise  # not reached: fail exits


def _matches(event: Mapping[str, Any], unit: str | None, since: float | None) -> bool:
    if since is not None and float(event["time"]) < since:
        return False
    if unit is None:
        return True
    name = event.get("unit") or ""
    return bool(name == unit or name.split("@", 1)[0] == unit)


def _follow(
    state_dir: Path, where: tuple[int, int] | None, poll: float
) -> Iterator[dict[str, Any]]:
    """Records appended after `where` (inode, offset), across rotations: the file is read
    through an open descriptor, so what was written just before it was renamed to .1 is
    read to its end before the new file is begun."""
    path = ev.events_path(state_dir)
    fh: BinaryIO | None = None
    pending = b""
    try:
        while True:
            if fh is None:
                fh = _open(path, where)
            if fh is not None:
                data = pending + fh.read()
                *lines, pending = data.split(b"\n")  # a line still being written waits
                for line in lines:
                    parsed = ev.parse_line(line.decode("utf-8", "replace"))
                    if parsed is not None:
                        yield parsed
                if _replaced(path, fh) and not fh.read(1):
                    fh.close()
                    fh, pending, where = None, b"", None
                    continue
            time.sleep(poll)
    finally:
        if fh is not None:
            fh.close()


def _open(path: Path, where: tuple[int, int] | None) -> BinaryIO | None:
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return None
    if where is not None and os.fstat(fh.fileno()).st_ino == where[0]:
        fh.seek(where[1])
    return fh


def _replaced(path: Path, fh: BinaryIO) -> bool:
    """The path names another file than `fh` now (rotated), or none."""
    try:
        return path.stat().st_ino != os.fstat(fh.fileno()).st_ino
    except FileNotFoundError:
        return True


def show(
    state_dir: Path,
    *,
    lines: int,
    follow: bool,
    unit: str | None,
    since: float | None,
    out: Callable[[str], None],
    render: Callable[[Mapping[str, Any]], str],
    poll: float = 0.2,
) -> None:
    history, where = ev.read(state_dir)
    window = deque((e for e in history if _matches(e, unit, since)), maxlen=lines or None)
    if lines == 0:
        window.clear()
    for event in window:
        out(render(event))
    if not follow:
        return
    for event in _follow(state_dir, where, poll):
        if _matches(event, unit, since):
            out(render(event))


@click.command("events")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, as stored.")
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(0, 1_000_000),
    default=50,
    show_default=True,
    help="Events of history to print first.",
)
@click.option(
    "--since",
    callback=_since,
    metavar="WHEN",
    help="Only events from then on: 10m, 2h, 1d, or a date-time (2026-12-02 22:40, 22:40).",
)
@click.option("-u", "--unit", default=None, help="Only this unit (a name covers its replicas).")
@click.pass_context
def events_command(
    ctx: click.Context,
    follow: bool,
    as_json: bool,
    lines: int,
    since: float | None,
    unit: str | None,
) -> None:
    """Print what happened to the stack: state changes and why, restarts and their delay,
    pushes, promotions, revocations (works after the daemon has gone too)."""
    state_dir = state_dir_of(ctx)
    path = ev.events_path(state_dir)
    if not follow and not path.exists() and not path.with_name(path.name + ".1").exists():
        fail(f"no events in {state_dir} (no stack has run with this state dir)")

    def render(event: Mapping[str, Any]) -> str:
        return json.dumps(event, separators=(",", ":")) if as_json else ev.format_line(event)

    try:
        show(state_dir, lines=lines, follow=follow, unit=unit, since=since,
             out=lambda line: click.echo(line), render=render)  # fmt: skip
    except OSError as exc:
        fail(f"cannot read the events: {exc.strerror or exc} ({exc.filename})")
    except KeyboardInterrupt:
        pass
