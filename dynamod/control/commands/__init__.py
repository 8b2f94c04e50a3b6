"""The commands, one module per command family."""

from __future__ import annotations

import click

from dynamod.control.commands.apply import apply_commands
from dynamod.control.commands.chaos import chaos_group
from dynamod.control.commands.events import events_command
from dynamod.control.commands.export import export_group
from dynamod.control.commands.lifecycle import lifecycle_commands
from dynamod.control.commands.policy import policy_group
from dynamod.control.commands.secrets import secrets_group
from dynamod.control.commands.systemd import systemd_group


def register_commands(main: click.Group) -> None:
    """Attach the commands defined in this package to the `dynamod` group."""
    for command in lifecycle_commands:
        main.add_command(command)
    for command in apply_commands:
        main.add_command(command)
    main.add_command(events_command)
    main.add_command(systemd_group)
    main.add_command(export_group)
    main.add_command(policy_group)
    main.add_command(chaos_group)
    main.add_command(secrets_group)
