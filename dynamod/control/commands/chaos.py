"""`dynamod chaos list|run|report`: runbook-driven fault injection (dynamod/chaos/)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dynamod.control.cliutil import fail
from dynamod.core.errors import DynamodError, SpecErrors

if TYPE_CHECKING:
    from dynamod.chaos.model import Runbook


@click.group("chaos")
def chaos_group() -> None:
    """Runbooks: real faults on a real stack, load, checkers over the recorded history."""


_dir_option = click.option(
    "--runbooks", "folder", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Folder of runbook files (default: the repository's runbooks/).")


def _load_all(folder: Path | None) -> list[object]:
    from dynamod.chaos import model

    try:
        return list(model.load_all(folder))
    except SpecErrors as exc:
        fail(f"invalid runbook, nothing was run.\n{exc}", 2)


@chaos_group.command("list")
@_dir_option
def list_command(folder: Path | None) -> None:
    """Each runbook in one line: name, quick/full time bounds, what it does, what it expects."""
    from dynamod.chaos.model import Runbook

    for runbook in _load_all(folder):
        assert isinstance(runbook, Runbook)
        expect = "" if runbook.expect == "pass" else f" [{runbook.expect}]"
        click.echo(f"{runbook.name:<28} quick <={runbook.quick.timeout:>4.0f}s  "
                   f"full <={runbook.full.timeout:>4.0f}s  {runbook.description}{expect}")


@chaos_group.command("run")
@click.argument("names", nargs=-1)
@click.option("--all", "run_all", is_flag=True, help="Every runbook in the folder.")
@click.option("--quick", is_flag=True, help="The CI profile (one pass, short load).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("chaos-runs"), show_default=True,
              help="Where each run's journal, history and timeline go; index.html is rewritten.")
@click.option("--fresh-stacks", is_flag=True,
              help="A stack of its own for every runbook (default: runbooks on the same "
                   "stack, vars and env share one started stack, restored between them).")
@_dir_option
def run_command(names: tuple[str, ...], run_all: bool, quick: bool, report_dir: Path,
                fresh_stacks: bool, folder: Path | None) -> None:
    """Run runbooks NAME... (or --all); exit 1 if any invariant fails or a run deviates."""
    from dynamod.chaos import model, report, runner
    from dynamod.chaos.journal import summary

    if not names and not run_all:
        fail("name one or more runbooks, or --all (see `dynamod chaos list`)", 2)
    try:
        if run_all:
            runbooks = model.load_all(folder)
        else:
            runbooks = [model.load(model.find(n, folder)) for n in names]
    except SpecErrors as exc:
        fail(f"invalid runbook, nothing was run.\n{exc}", 2)
    for runbook in runbooks:
        _check_vars(runbook)
    profile = model.Profile.QUICK if quick else model.Profile.FULL
    report_dir = report_dir.absolute()
    journals = [j.as_dict() for j in runner.run_all(runbooks, profile, report_dir,
                                                     echo=click.echo, share=not fresh_stacks)]
    index = report.write_index(report_dir)
    click.echo("")
    click.echo(summary(journals))
    click.echo(f"\nreport: {index}")
    sys.exit(0 if all(j["passed"] for j in journals) else 1)


def _check_vars(runbook: Runbook) -> None:
    """A runbook's `vars` are its stack's `--var`s: one the stack has no variable for is
    refused before any run starts, as `up` would refuse it."""
    from dynamod.control import tables
    from dynamod.core import paths, spec

    tables.register()
    try:
        raw = spec.load_stack(paths.resolve_stack_path(runbook.stack_path()))
        spec.check_overrides(raw, runbook.vars)
    except DynamodError as exc:
        fail(f"runbook {runbook.source or runbook.name}: {exc} (nothing was run)", 2)


@chaos_group.command("report")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--last", default=50, show_default=True, help="How many runs the page lists.")
def report_command(folder: Path, last: int) -> None:
    """Write FOLDER/index.html: the last runs with their verdicts and timelines."""
    from dynamod.chaos import report

    if not folder.is_dir():
        fail(f"{folder}: no such folder of chaos runs", 2)
    index = report.write_index(folder, last)
    click.echo(f"{index}: {len(report.runs(folder, last))} runs")
