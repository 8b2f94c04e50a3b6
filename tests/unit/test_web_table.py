"""The stack file's `[web]` table (ops/web_table.py): checked with the stack, a field named
for each problem; its settings are what `up --web` would give."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest

from dynamod.core.errors import SpecErrors
from dynamod.core.spec import Stack, load_stack, resolve_stack
from dynamod.ops import statuspage, web_table

STACK = """
[stack]
name = "paged"
[units.db]
command = ["sleep", "600"]
"""


def resolved(tmp_path: Path, web: str) -> Stack:
    path = tmp_path / "paged.toml"
    path.write_text(textwrap.dedent(STACK) + textwrap.dedent(web))
    ports = itertools.count(31000)
    return resolve_stack(
        load_stack(path), state_dir=tmp_path, allocate_port=lambda *a, **k: next(ports)
    )


def test_no_table_no_page(tmp_path: Path) -> None:
    assert web_table.settings_of(resolved(tmp_path, "")) is None


def test_the_table_gives_the_settings_up_web_would(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token-0123456789\n")
    stack = resolved(tmp_path, """
    [web]
    address = "0.0.0.0:8470"
    token_file = "token"
    """)
    settings = web_table.settings_of(stack)
    assert settings == statuspage.WebSettings("0.0.0.0", 8470, "s3cret-token-0123456789")
    stack = resolved(tmp_path, '[web]\naddress = "127.0.0.1:8471"\n')
    assert web_table.settings_of(stack) == statuspage.WebSettings("127.0.0.1", 8471)


@pytest.mark.parametrize(("web", "field", "words"), [
    ('[web]\naddress = "10.1.2.3:80"\n', "web.token_file", "not a loopback address"),
    ('[web]\naddress = "nowhere"\n', "web.address", "expects HOST:PORT"),
    ('[web]\naddress = "127.0.0.1:99999"\n', "web.address", "port"),
    ('[web]\nport = 8470\naddress = "127.0.0.1:1"\n', "web.port", "unknown key"),
])
def test_a_bad_table_names_its_field(tmp_path: Path, web: str, field: str, words: str) -> None:
    with pytest.raises(SpecErrors) as caught:
        resolved(tmp_path, web)
    said = str(caught.value)
    assert f"field '{field}'" in said and words in said and "paged.toml" in said, said
