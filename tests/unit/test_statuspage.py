"""The status page's rules (ops/statuspage.py): which addresses `up --web` takes, the
loopback-or-token rule, who may see the page, the chaos runs it lists; and `up`'s
refusals through the real CLI (in-process: nothing may start). The page in a browser is
tests/integration/test_status_page.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynamod.chaos.report import runs
from dynamod.ops import statuspage as sp
from tests import cli_inprocess

TOKEN = "0123456789abcdef0123"


@pytest.mark.parametrize("text, expect", [
    ("127.0.0.1:8470", ("127.0.0.1", 8470)),
    ("localhost:1", ("localhost", 1)),
    ("[::1]:65535", ("::1", 65535)),
    ("0.0.0.0:8470", ("0.0.0.0", 8470)),
])  # fmt: skip
def test_addresses_taken(text: str, expect: tuple[str, int]) -> None:
    assert sp.parse_address(text) == expect


@pytest.mark.parametrize("text, words", [
    ("127.0.0.1", "expects HOST:PORT"),
    (":8470", "expects HOST:PORT"),
    ("127.0.0.1:", "expects HOST:PORT"),
    ("127.0.0.1:0", "a port from 1 to 65535"),
    ("127.0.0.1:70000", "a port from 1 to 65535"),
    ("127.0.0.1:-1", "expects HOST:PORT"),
    ("127.0.0.1:\uff18\uff10", "expects HOST:PORT"),  # fullwidth 80: int() would take it
    ("example.org:80", "an IP address or localhost"),
])  # fmt: skip
def test_addresses_refused(text: str, words: str) -> None:
    with pytest.raises(sp.WebAddressError, match=words):
        sp.parse_address(text)


def test_beyond_loopback_only_with_a_token(tmp_path: Path) -> None:
    assert sp.settings("127.0.0.1:8470", None) == sp.WebSettings("127.0.0.1", 8470, None)
    assert sp.settings("[::1]:8470", None).token is None
    for address in ("0.0.0.0:8470", "192.168.1.5:8470", "[::]:8470"):
        with pytest.raises(sp.WebAddressError, match=r"not a loopback address.*--web-token"):
            sp.settings(address, None)
    token = tmp_path / "token"
    token.write_text(f"  {TOKEN}\nsecond line ignored\n")
    assert sp.settings("0.0.0.0:8470", token) == sp.WebSettings("0.0.0.0", 8470, TOKEN)


@pytest.mark.parametrize("content, words", [
    ("short\n", "at least 16"),
    ("", "at least 16"),
    ("has a space in it, long enough\n", "at least 16"),
    (None, "cannot read the token file"),
])  # fmt: skip
def test_bad_token_files_are_refused(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(sp.WebAddressError, match=words):
        sp.read_token(path)


@pytest.mark.parametrize("host, token, given, expect", [
    ("127.0.0.1:8470", None, None, True),
    ("localhost:8470", None, None, True),
    ("[::1]:8470", None, None, True),
    ("127.0.0.1", None, None, True),
    ("rebound.example:8470", None, None, False),  # DNS rebinding: a name pointed at us
    ("10.0.0.1:8470", None, None, False),
    (None, None, None, False),
    ("10.0.0.1:8470", TOKEN, TOKEN, True),
    ("10.0.0.1:8470", TOKEN, None, False),
    ("127.0.0.1:8470", TOKEN, None, False),  # a token, once set, is asked on loopback too
    ("127.0.0.1:8470", TOKEN, TOKEN + "x", False),
    ("127.0.0.1:8470", TOKEN, "é" * 20, False),
])  # fmt: skip
def test_who_may_see_the_page(
    host: str | None, token: str | None, given: str | None, expect: bool
) -> None:
    assert sp.allowed(host, token, given) is expect


def test_chaos_runs_listed_newest_first_with_their_timelines(tmp_path: Path) -> None:
    assert sp.chaos_listing(tmp_path / "none", runs) == []
    for name, start, picture in (("a", "2026-12-01T10:00", True), ("b", "2026-12-02T10:00", False)):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / "journal.json").write_text(json.dumps({
            "experiment": {"name": name}, "start": start, "verdict": "passed", "passed": True}))
        if picture:
            (run / "timeline.png").write_bytes(b"png")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "journal.json").write_text("{")
    listed = sp.chaos_listing(tmp_path, runs)
    assert [(r["run"], r["name"], r["timeline"]) for r in listed] == [
        ("run-b", "b", False), ("run-a", "a", True)]


@pytest.mark.parametrize("args, words", [
    (["--web", "0.0.0.0:8470"], "not a loopback address"),
    (["--web", "127.0.0.1:70000"], "expects a port from 1 to 65535"),
    (["--web", "127.0.0.1:http"], "expects HOST:PORT"),
    (["--web", "127.0.0.1:8470", "--web-token", "/nonexistent/token"], "cannot read"),
    (["--web-token", "/nonexistent/token"], "--web-token needs --web"),
])  # fmt: skip
def test_up_refuses_a_bad_web_address_with_one_line(
    tmp_path: Path, args: list[str], words: str
) -> None:
    state = tmp_path / "s"
    result = cli_inprocess.run(["--state-dir", str(state), "up", "local", "--detach", *args])
    lines = result.stderr.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result
    assert lines[0].startswith("dynamod: up") and words in lines[0], lines
    assert not state.exists()  # refused before anything was made


def test_the_folder_stamp_changes_with_a_new_run_or_a_journal_written(tmp_path: Path) -> None:
    assert sp.folder_stamp(tmp_path / "none") == ()
    (tmp_path / "run-a").mkdir()
    first = sp.folder_stamp(tmp_path)
    (tmp_path / "run-a" / "journal.json").write_text("{}")
    os.utime(tmp_path / "run-a", ns=(1, 1))  # as if the write came a tick later
    second = sp.folder_stamp(tmp_path)
    (tmp_path / "run-b").mkdir()
    (tmp_path / "stray.txt").write_text("")
    assert first != second and [n for n, _ in sp.folder_stamp(tmp_path)] == ["run-a", "run-b"]
