"""A report as a list of blocks, written out as Markdown (with its pictures beside it) and as
one self-contained HTML file (pictures embedded as base64 PNG).

Text in a block is data, never markup: a ``str`` is shown as it reads, whatever it holds
(a run named ``<script>`` or ``[x](javascript:...)`` is shown as those characters). What is
bold, code or a link is said with :class:`Bold`, :class:`Mono` and :class:`Link` pieces, so
that no name read from a run folder can turn into markup. Each output has one escaping
function that every piece of text goes through: :func:`markdown_escape` and
:func:`html_escape` (in text and attributes alike); LaTeX's is ``fedskew.report.latex.escape``.
Links go out only to http(s) or relative addresses (:func:`safe_url`).
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from fedskew.core.durable import write_bytes_durably


@dataclass(frozen=True)
class Bold:
    text: str


@dataclass(frozen=True)
class Mono:
    """A command or a path, in a code font."""

    text: str


@dataclass(frozen=True)
class Link:
    text: str
    url: str  # http(s) or relative; any other is written as its text alone


Span = str | Bold | Mono | Link
Text = Span | Sequence[Span]  # a str alone is one span, not a sequence of characters


@dataclass
class Heading:
    level: int
    text: Text


@dataclass
class Para:
    text: Text


@dataclass
class Bullets:
    items: list[Text]


@dataclass
class Table:
    header: list[Text]
    rows: list[list[Text]]


@dataclass
class Image:
    name: str  # file name of the PNG beside the Markdown (made safe when written)
    png: bytes
    caption: str


@dataclass
class Code:
    text: str


@dataclass
class Attachment:
    """A file beside the pictures (a table as CSV or LaTeX): the Markdown links to it by
    its relative name; the HTML page, which holds no address outside itself (and no data:
    link, an address :func:`safe_url` refuses), names it."""

    name: str  # file name with its suffix (made safe when written)
    content: str  # written as UTF-8 (a lone surrogate, from a name that is not, as U+FFFD)
    text: str  # what the file is, shown before the link


Block = Heading | Para | Bullets | Table | Image | Code | Attachment


def spans(text: Text) -> list[Span]:
    if isinstance(text, (str, Bold, Mono, Link)):
        return [text]
    return list(text)


def plain_text(text: Text) -> str:
    """The characters of ``text`` without its styles (for tests and plain outputs)."""
    return "".join(s if isinstance(s, str) else s.text for s in spans(text))


# Characters that would break a line or a table, or hide what follows: control characters
# (newlines included), line and paragraph separators, and the bidirectional overrides
# that make text display in another order than it reads ("Trojan source").
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_BIDI = re.compile(r"[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # a file name that is not UTF-8, say


def one_line(text: str) -> str:
    """``text`` as one printable line in UTF-8: the characters above made visible or
    blank."""
    text = _CONTROL.sub(" ", str(text))
    return _SURROGATE.sub("\ufffd", _BIDI.sub("\ufffd", text))


def safe_url(url: str) -> str | None:
    """``url`` if it is an http(s) or a relative address, else None (javascript:, data:,
    file:, a network-path ``//host`` and anything a browser might read as one)."""
    # As a browser or a Markdown renderer reads it: entities decoded ("&colon;"), and the
    # spaces and control characters that browsers drop inside a scheme dropped.
    cleaned = re.sub(r"[\x00-\x20\x7f]", "", html.unescape(url))
    try:
        scheme = urlsplit(cleaned).scheme.lower()
    except ValueError:
        return None
    if scheme not in ("", "http", "https") or cleaned.startswith(("//", "\\\\", "/\\", "\\/")):
        return None
    if not scheme and ":" in cleaned.split("/", 1)[0]:
        return None  # "javascript&colon;..." and the like: no scheme urlsplit accepts
    return quote(one_line(url).strip(), safe="/:?#@!$&'*+,;=%~-._")


# ------------------------------------------------------------------------- Markdown

# Backslash escapes for CommonMark and GitHub's Markdown: emphasis, code, raw HTML and
# entities, tables, headings, strikethrough; an underscore only where it could start or end
# emphasis (not inside a word: num_clients stays readable); a ] only where it could close a
# link, an image, a reference or its definition ("](", "][", "]:", or at the end of the
# text, before what follows it), so that "[-0.95, +0.81]" stays as it reads.
_MARKDOWN = re.compile(r"[\\`*<>&|#~]|(?<![^\W_])_|_(?![^\W_])|\](?=[(\[:]|$)")
# What starts a list item when a paragraph begins with it: "- ", "+ ", "1. ", "1) ".
_LIST_MARKER = re.compile(r"^(\d{1,9}(?=[.)](\s|$))|(?=[-+](\s|$)))")


def markdown_escape(text: str) -> str:
    """``text`` as Markdown that shows exactly those characters, on one line."""
    return _MARKDOWN.sub(lambda m: "\\" + m.group(0), one_line(text))


def _markdown_code(text: str, in_table: bool) -> str:
    """A code span: fenced by more backticks than the text holds in a row."""
    text = one_line(text)
    if in_table:
        text = text.replace("|", "\\|")  # GitHub reads a bare | in a code span as a cell end
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_text(text: Text, in_table: bool = False) -> str:
    out = []
    for span in spans(text):
        if isinstance(span, str):
            out.append(markdown_escape(span))
        elif isinstance(span, Bold):
            out.append(f"**{markdown_escape(span.text.strip())}**" if span.text.strip() else "")
        elif isinstance(span, Mono):
            out.append(_markdown_code(span.text, in_table))
        else:
            url = safe_url(span.url)  # quoted: no space, bracket or parenthesis left in it
            label = markdown_escape(span.text)
            out.append(f"[{label}]({url})" if url else label)
    text = "".join(out).strip()
    if in_table:  # a cell holds inline text only
        return text
    # At the start of a paragraph or a list item, "1. " or "- " would open a list.
    return _LIST_MARKER.sub(lambda m: m.group(0) + "\\", text, count=1)


def _fence(text: str) -> str:
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=2)
    return "`" * (longest + 1)


def safe_file_name(name: str, taken: set[str], suffix: str = ".png") -> str:
    """A file name for a picture (or another file: ``suffix``) that every file system takes
    and a link needs no escape for: letters, digits and ``._-``, at most 100 characters,
    not one in ``taken``."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name.removesuffix(suffix)).strip("._")[:96]
    stem = stem or ("picture" if suffix == ".png" else "file")
    found, n = f"{stem}{suffix}", 1
    while found in taken:
        n += 1
        found = f"{stem}-{n}{suffix}"
    taken.add(found)
    return found


def file_names(blocks: list[Block]) -> dict[int, str]:
    """The file name of each picture and attachment (by the block's index), unique and
    safe, the same for the Markdown and the HTML."""
    taken: set[str] = set()
    names = {}
    for i, block in enumerate(blocks):
        if isinstance(block, Image):
            names[i] = safe_file_name(block.name, taken)
        elif isinstance(block, Attachment):
            names[i] = safe_file_name(block.name, taken, _suffix(block.name))
    return names


def to_markdown(blocks: list[Block], files_dir: str) -> tuple[str, dict[str, bytes]]:
    """The Markdown text and the pictures and attachments it links to (file name -> bytes),
    which go in ``files_dir`` beside the Markdown file."""
    out: list[str] = []
    files: dict[str, bytes] = {}
    names = file_names(blocks)
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            out.append("#" * min(max(block.level, 1), 6) + " " + markdown_text(block.text))
        elif isinstance(block, Para):
            out.append(markdown_text(block.text))
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {markdown_text(item)}" for item in block.items))
        elif isinstance(block, Table):
            cells = [markdown_text(h, in_table=True) for h in block.header]
            lines = ["| " + " | ".join(cells) + " |", "|" + "---|" * len(block.header)]
            for row in block.rows:
                lines.append("| " + " | ".join(markdown_text(c, in_table=True) for c in row) + " |")
            out.append("\n".join(lines))
        elif isinstance(block, Image):
            name = names[i]
            files[name] = block.png
            caption = markdown_escape(block.caption)
            out.append(f"![{caption}]({files_dir}/{name})\n\n{caption}")
        elif isinstance(block, Code):
            fence = _fence(block.text)
            text = _SURROGATE.sub("\ufffd", block.text.rstrip("\n"))
            out.append(f"{fence}\n{text}\n{fence}")
        elif isinstance(block, Attachment):
            name = names[i]
            files[name] = _SURROGATE.sub("\ufffd", block.content).encode("utf-8")
            link = f"[{markdown_escape(name)}]({files_dir}/{name})"
            out.append(f"{markdown_escape(block.text)}: {link}")
    return "\n\n".join(out) + "\n", files


def _suffix(name: str) -> str:
    """A file name's suffix as :func:`safe_file_name` keeps it: letters and digits only."""
    found = re.search(r"\.[A-Za-z0-9]{1,8}$", name)
    return found.group(0) if found else ".txt"


# ----------------------------------------------------------------------------- HTML


def html_escape(text: str) -> str:
    """``text`` as HTML text or a quoted attribute value that shows those characters."""
    return html.escape(one_line(text), quote=True)


def html_text(text: Text) -> str:
    out = []
    for span in spans(text):
        if isinstance(span, str):
            out.append(html_escape(span))
        elif isinstance(span, Bold):
            out.append(f"<strong>{html_escape(span.text)}</strong>")
        elif isinstance(span, Mono):
            out.append(f"<code>{html_escape(span.text)}</code>")
        else:
            url = safe_url(span.url)
            label = html_escape(span.text)
            out.append(f'<a href="{html_escape(url)}">{label}</a>' if url else label)
    return "".join(out)


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


def to_html(blocks: list[Block], title: str, files_dir: str | None = None) -> str:
    """One HTML file with everything in it (styles inline, PNGs as data: URLs) but the
    attachments, which it names (in ``files_dir`` beside it) without linking to them."""
    body: list[str] = []
    names = file_names(blocks)
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            level = min(max(block.level, 1), 6)
            body.append(f"<h{level}>{html_text(block.text)}</h{level}>")
        elif isinstance(block, Para):
            body.append(f"<p>{html_text(block.text)}</p>")
        elif isinstance(block, Bullets):
            items = "".join(f"<li>{html_text(i)}</li>" for i in block.items)
            body.append(f"<ul>{items}</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html_text(h)}</th>" for h in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html_text(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(block, Image):
            data = base64.b64encode(block.png).decode("ascii")
            body.append(
                f'<figure><img alt="{html_escape(block.caption)}" '
                f'src="data:image/png;base64,{data}"><figcaption>{html_escape(block.caption)}'
                "</figcaption></figure>"
            )
        elif isinstance(block, Code):
            text = _SURROGATE.sub("\ufffd", block.text)
            body.append(f"<pre><code>{html.escape(text, quote=True)}</code></pre>")
        elif isinstance(block, Attachment):
            # Named, not linked: the page holds no address outside itself.
            where = f"{files_dir}/{names[i]}" if files_dir else names[i]
            body.append(f"<p>{html_escape(block.text)}: <code>{html_escape(where)}</code></p>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html_escape(title)}</title><style>{STYLE}</style></head><body>\n"
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
        pictures = folder / files_dir
        if pictures.is_symlink():
            # Written through, a link left in a shared folder would put the pictures
            # wherever it points; report.md and report.html replace a link the same way.
            pictures.unlink()
        pictures.mkdir(exist_ok=True)
        for name, png in files.items():
            write_bytes_durably(folder / files_dir / name, png)
    md = folder / f"{stem}.md"
    page = folder / f"{stem}.html"
    write_bytes_durably(md, text.encode("utf-8"))
    write_bytes_durably(page, to_html(blocks, title, files_dir).encode("utf-8"))
    return md, page
