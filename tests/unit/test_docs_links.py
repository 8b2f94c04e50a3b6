"""Every relative link in README.md and docs/*.md points at a file that exists, so a page
that is moved or renamed cannot leave the README or another page pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                out.append(f"{page.relative_to(root)}: {target}")
    return out


def test_every_relative_link_of_the_readme_and_the_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5
    assert broken_links(pages) == []


def test_a_link_to_a_missing_page_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("x")
    page.write_text(
        "[a](docs/there.md) [b](docs/gone.md#part) [c](https://example.org) [d](#top)\n"
        "```\n[e](not/checked/in/code.md)\n```\n"
    )
    assert broken_links([page], tmp_path) == ["README.md: docs/gone.md#part"]
