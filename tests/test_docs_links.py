"""Every relative link in README.md and docs/*.md points at a file of the repository (and, with
an anchor into a Markdown file, at one of its headings). No network: web links are not checked.

The documentation is read in two places, a repository browser and the MkDocs site, and both
need the relative links right; mkdocs build --strict checks the links between docs/ pages,
this test also covers README.md and links from docs/ to the rest of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) or ![alt](target), with an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")


def _links(text: str) -> list[str]:
    """Link targets outside fenced code blocks and inline code."""
    found: list[str] = []
    in_code = False
    for line in text.split("\n"):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            found += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


def _slug(heading: str) -> str:
    # The anchor GitHub and MkDocs' toc both give a heading: lower case, punctuation dropped,
    # spaces as hyphens.
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r" ", "-", text)


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_pages_exist() -> None:
    assert (ROOT / "docs" / "index.md").is_file() and len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page: Path) -> None:
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # a web address (or mailto:): not checked without network
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif not file.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_check_sees_links() -> None:
    # Guards the regular expression: a page full of links must not pass by finding none.
    links = _links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "docs/options.md" in links and "#install-cpu-or-cuda" in links
    assert not _links("```\n[x](nowhere.md)\n```\n`[y](nowhere.md)`")
