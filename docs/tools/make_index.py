"""docs/index.md, the site's home page, is README.md with its links re-aimed from docs/:
``python docs/tools/make_index.py`` writes it, ``--check`` exits 1 when it differs
(tests/test_docs_index.py runs the check, so the two cannot drift apart).

What changes between the two, and nothing else:

- links into docs/ lose the ``docs/`` prefix (``docs/options.md`` -> ``options.md``);
- other links to repository files gain ``../`` (``SECURITY.md`` -> ``../SECURITY.md``), which the
  site's hook (docs/hooks/repo_links.py) then resolves;
- a paragraph or list item that links to docs/index.md itself (the README's pointer to the
  documentation) is left out: on the home page it would point at itself.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "index.md"
HEADER = "<!-- Generated from README.md by python docs/tools/make_index.py: edit README.md. -->\n"

# [text](target) or ![alt](target), with an optional "title".
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def _retarget(target: str) -> str:
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target  # a web address, an anchor of this page or a site path: unchanged
    if target.startswith("docs/"):
        return target[len("docs/"):]
    return "../" + target


def _blocks(text: str) -> list[str]:
    """Paragraphs, list items and fenced code blocks, each with its trailing newlines."""
    blocks: list[str] = []
    current: list[str] = []
    in_code = False
    for line in text.splitlines(keepends=True):
        fence = line.lstrip().startswith("```")
        starts_item = not in_code and re.match(r"^\s*- ", line) is not None
        if (starts_item or (fence and not in_code)) and current:
            blocks.append("".join(current))
            current = []
        current.append(line)
        if fence:
            in_code = not in_code
        if not in_code and (line.strip() == "" or fence and not in_code):
            blocks.append("".join(current))
            current = []
    if current:
        blocks.append("".join(current))
    return blocks


def make_index(readme: str) -> str:
    out = []
    for block in _blocks(readme):
        if block.lstrip().startswith("```"):
            out.append(block)  # commands are the same from either folder
            continue
        if "](docs/index.md)" in block or "](docs/index.md#" in block:
            continue
        lines = []
        for line in block.splitlines(keepends=True):
            # Inline code keeps its text: only links outside backticks are re-aimed.
            parts = re.split(r"(`[^`]*`)", line)
            lines.append("".join(
                p if p.startswith("`") else _LINK.sub(
                    lambda m: m.group(1) + _retarget(m.group(2)) + m.group(3), p)
                for p in parts
            ))
        out.append("".join(lines))
    return HEADER + "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="docs/index.md from README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/index.md differs")
    args = parser.parse_args(argv)
    wanted = make_index(README.read_text(encoding="utf-8"))
    if args.check:
        if INDEX.read_text(encoding="utf-8") != wanted:
            print("docs/index.md differs from README.md: run python docs/tools/make_index.py",
                  file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(wanted, encoding="utf-8")
    print(f"wrote {INDEX.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
