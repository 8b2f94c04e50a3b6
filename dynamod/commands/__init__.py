"""Command groups that live in their own modules (one module per command family)."""

from __future__ import annotations

import click


def register_commands(main: click.Group) -> None:
    """Attach the command groups defined in this package to the `dynamod` group."""
