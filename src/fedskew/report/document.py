"""A report as a list of blocks, written out as Markdown (with its pictures beside it) and as
one self-contained HTML file (pictures embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

from fedskew.core.durable import write_bytes_durably


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str  # `code` spans and **bold** are understood by both outputs


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    name: str  # file name of the PNG beside the Markdown
    png: bytes
    caption: str


@dataclass
class Code:
    text: str


Block = Heading | Para | Bullets | Table | Image | Code


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block], files_dir: str) -> tuple[str, dict[str, bytes]]:
    """The Markdown text and the pictures it links to (file name -> PNG bytes), which go
    in ``files_dir`` beside the Markdown file."""
    out: list[str] = []
    files: dict[str, bytes] = {}
    for block in blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Para):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(_md_cell(h) for h in block.header) + " |"]
            lines.append("|" + "---|" * len(block.header))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            out.append("\n".join(lines))
        elif isinstance(block, Image):
            files[block.name] = block.png
            out.append(f"![{block.caption}]({files_dir}/{block.name})\n\n{block.caption}")
        elif isinstance(block, Code):
            out.append("```\n" + block.text.rstrip("\n") + "\n```")
    return "\n\n".join(out) + "\n", files


_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")


def _inline(text: str) -> str:
    """HTML for a line of text with `code`, **bold** and [links](url)."""
    parts, pos = [], 0
    for m in _INLINE.finditer(text):
        parts.append(html.escape(text[pos : m.start()]))
        if m.group(1) is not None:
            parts.append(f"<code>{html.escape(m.group(1))}</code>")
        elif m.group(2) is not None:
            parts.append(f"<strong>{html.escape(m.group(2))}</strong>")
        else:
            parts.append(f'<a href="{html.escape(m.group(4))}">{html.escape(m.group(3))}</a>')
        pos = m.end()
    parts.append(html.escape(text[pos:]))
    return "".join(parts)


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6em; border-bottom: 2px solid #ddd; padding-bottom: .2em; }
h2 { font-size: 1.3em; margin-top: 1.8em; border-bottom: 1px solid #eee; }
h3 { font-size: 1.1em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .88em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr:nth-child(even) td { background: #fafafa; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: .9em; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .88em; color: #555; }
"""


def to_html(blocks: list[Block], title: str) -> str:
    """One HTML file with everything in it (styles inline, PNGs as data: URLs)."""
    body: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            level = min(max(block.level, 1), 6)
            body.append(f"<h{level}>{_inline(block.text)}</h{level}>")
        elif isinstance(block, Para):
            body.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            items = "".join(f"<li>{_inline(i)}</li>" for i in block.items)
            body.append(f"<ul>{items}</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(block, Image):
            data = base64.b64encode(block.png).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block.caption)}" '
                f'src="data:image/png;base64,{data}"><figcaption>{_inline(block.caption)}'
                "</figcaption></figure>"
            )
        elif isinstance(block, Code):
            body.append(f"<pre><code>{html.escape(block.text)}</code></pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def write_report(blocks: list[Block], folder: Path, stem: str, title: str) -> tuple[Path, Path]:
    """``folder/<stem>.md`` with its pictures in ``folder/<stem>_files/``, and
    ``folder/<stem>.html``; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    files_dir = f"{stem}_files"
    text, files = to_markdown(blocks, files_dir)
    if files:
        (folder / files_dir).mkdir(exist_ok=True)
        for name, png in files.items():
            write_bytes_durably(folder / files_dir / name, png)
    md = folder / f"{stem}.md"
    page = folder / f"{stem}.html"
    write_bytes_durably(md, text.encode("utf-8"))
    write_bytes_durably(page, to_html(blocks, title).encode("utf-8"))
    return md, page
