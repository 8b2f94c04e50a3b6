"""The commands, one module per command family, imported only when one of theirs runs:
`dynamod status` then costs the socket client and the renderer, not the stack models, the
chaos runner and the exporters every other command needs (a start of ~0.7 s on a quiet
2-core machine, several seconds on a loaded one)."""

from __future__ import annotations

import importlib

import click

# The command's name -> (its module under dynamod/control/commands/, the object in it), in
# the order `dynamod --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("lifecycle", "check"),
    "up": ("lifecycle", "up"),
    "down": ("lifecycle", "down"),
    "status": ("units", "status"),
    "restart": ("units", "restart"),
    "stop": ("units", "stop"),
    "start": ("units", "start"),
    "logs": ("units", "logs"),
    "apply": ("apply", "apply"),
    "scale": ("apply", "scale"),
    "events": ("events", "events_command"),
    "systemd": ("systemd", "systemd_group"),
    "export": ("export", "export_group"),
    "policy": ("policy", "policy_group"),
    "chaos": ("chaos", "chaos_group"),
    "secrets": ("secrets", "secrets_group"),
    "cluster": ("cluster", "cluster_group"),
}


def load(name: str) -> click.Command | None:
    """The command `name`, its module imported now; None for a name that is no command."""
    where = COMMANDS.get(name)
    if where is None:
        return None
    module, attribute = where
    command = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    assert isinstance(command, click.Command), (name, command)
    return command
