"""The stack file's `[web]` table: the status page `up` serves when it is not given
`--web` (which, with `--web-token`, overrides the table):

    [web]
    address = "127.0.0.1:8470"           # HOST:PORT; templates work ("{vars.web_port}")
    token_file = "/etc/dynamod/page"      # optional; required beyond loopback

Registered with the core's spec tables by `register()`, as the rollout layer registers
`[policy]`; the address is checked with the stack (`dynamod check` names the field), the
token file is read by `up`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from dynamod.core.errors import SpecError
from dynamod.core.spec import SpecModel, Stack, StackTable, UnitSpec, register_stack_table

if TYPE_CHECKING:
    from dynamod.ops.statuspage import WebSettings

KEY = "web"


class WebTable(SpecModel):
    """Where `up` serves the status page (`[web]` table)."""

    address: str = Field(description="HOST:PORT of the status page (loopback, or a token)")
    token_file: Path | None = Field(
        None, description="file whose first line is the token the page asks of every request"
    )


def check(web: WebTable, specs: Mapping[str, UnitSpec], path: Path) -> list[SpecError]:
    """The address parses; beyond loopback it needs a token file."""
    from dynamod.ops import statuspage  # aiohttp: only for a stack that has the table

    del specs
    try:
        host, _ = statuspage.parse_address(web.address)
        beyond = not statuspage.is_loopback(host)
    except (statuspage.WebAddressError, ValueError) as exc:
        return [SpecError(str(exc), file=path, field="web.address")]
    if beyond and web.token_file is None:
        return [SpecError(f"{web.address} is not a loopback address; the status page is "
                          "served beyond loopback only with token_file", file=path,
                          field="web.token_file")]  # fmt: skip
    return []


def web_of(stack: Stack) -> WebTable | None:
    table = stack.tables.get(KEY)
    return table if isinstance(table, WebTable) else None


def settings_of(stack: Stack) -> WebSettings | None:
    """The stack's `[web]` table as the page's settings (None: no table). Raises
    WebAddressError (an unreadable token file)."""
    from dynamod.ops import statuspage

    web = web_of(stack)
    if web is None:
        return None
    token_file = web.token_file
    if token_file is not None and not token_file.is_absolute():
        token_file = stack.path.parent / token_file
    return statuspage.settings(web.address, token_file)


def register() -> None:
    register_stack_table(StackTable(KEY, WebTable, check=check))
