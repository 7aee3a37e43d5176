"""MkDocs hook: the TeX of the pages (docs/algorithms.md) becomes MathML when the site is built.

Browsers render MathML Core natively (Chromium from 109, Firefox, Safari), so the built pages
show their equations without any script and without a network: nothing is fetched at view time.
pymdownx.arithmatex (generic mode, mkdocs.yml) keeps the TeX away from Markdown and leaves it in
``<span class="arithmatex">\\(...\\)</span>`` and ``<div class="arithmatex">\\[...\\]</div>``;
this hook converts each with latex2mathml (the ``docs`` extra) and fails the build on an
equation it cannot convert faithfully, instead of shipping TeX source or a wrong formula.

Two gaps of latex2mathml are closed here, both checked by tests/test_docs_site.py:

- a few commands it does not know or does not size (``\\arg``, ``\\big\\|``) are rewritten to
  equivalents it does know before conversion (``_REWRITES``);
- it expresses calligraphic, blackboard-bold and bold letters with ``mathvariant``, which MathML
  Core (what Chromium implements) ignores except for ``normal``; such letters are replaced by
  their Unicode mathematical alphanumeric characters, which render everywhere.
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from typing import Any

from mkdocs.exceptions import PluginError

_MATHML_NS = "http://www.w3.org/1998/Math/MathML"
ET.register_namespace("", _MATHML_NS)

# What arithmatex's generic mode writes: the TeX, HTML-escaped, inside \( \) or \[ \].
_ARITHMATEX = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[(\[])(?P<tex>.*?)\\[)\]]\s*</(?P=tag)>',
    re.S,
)

# Delimiters latex2mathml sizes only as characters: \big\| would come out as the text "\|".
_DELIMITERS = {
    r"\|": "‖", r"\Vert": "‖", r"\lVert": "‖", r"\rVert": "‖",
    r"\vert": "|", r"\lvert": "|", r"\rvert": "|",
    r"\langle": "⟨", r"\rangle": "⟩",
    r"\lfloor": "⌊", r"\rfloor": "⌋", r"\lceil": "⌈", r"\rceil": "⌉",
}
_SIZED = re.compile(
    r"(\\(?:big|Big|bigg|Bigg)[lrm]?)\s*("
    + "|".join(
        re.escape(d) + ("(?![A-Za-z])" if d[-1].isalpha() else "")
        for d in sorted(_DELIMITERS, key=len, reverse=True)
    )
    + ")"
)
_REWRITES = [
    # \arg is an operator name latex2mathml does not have; upright "arg" is what TeX prints.
    (re.compile(r"\\arg(?![A-Za-z])\s*"), r"\\mathrm{arg}\\,"),
]


def _letters(start: int, exceptions: dict[str, str], alphabet: str) -> dict[str, str]:
    table = {c: chr(start + i) for i, c in enumerate(alphabet)}
    table.update(exceptions)
    return table


_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LOWER = "abcdefghijklmnopqrstuvwxyz"
# Unicode's Mathematical Alphanumeric Symbols; the holes in each block are letters that were
# encoded earlier in Letterlike Symbols (the exceptions).
_VARIANTS: dict[str, dict[str, str]] = {
    "script": {
        **_letters(0x1D49C, {"B": "ℬ", "E": "ℰ", "F": "ℱ", "H": "ℋ", "I": "ℐ", "L": "ℒ",
                             "M": "ℳ", "R": "ℛ"}, _UPPER),
        **_letters(0x1D4B6, {"e": "ℯ", "g": "ℊ", "o": "ℴ"}, _LOWER),
    },
    "double-struck": {
        **_letters(0x1D538, {"C": "ℂ", "H": "ℍ", "N": "ℕ", "P": "ℙ", "Q": "ℚ", "R": "ℝ",
                             "Z": "ℤ"}, _UPPER),
        **_letters(0x1D7D8, {}, "0123456789"),
    },
    "bold": {
        **_letters(0x1D400, {}, _UPPER),
        **_letters(0x1D41A, {}, _LOWER),
        **_letters(0x1D7CE, {}, "0123456789"),
    },
    "fraktur": {
        **_letters(0x1D504, {"C": "ℭ", "H": "ℌ", "I": "ℑ", "R": "ℜ", "Z": "ℨ"}, _UPPER),
        **_letters(0x1D51E, {}, _LOWER),
    },
}


class MathError(ValueError):
    """An equation that cannot be turned into MathML faithfully."""


def _prepare(tex: str) -> str:
    tex = _SIZED.sub(lambda m: m.group(1) + _DELIMITERS[m.group(2)], tex)
    for pattern, replacement in _REWRITES:
        tex = pattern.sub(replacement, tex)
    return tex


def _fix_variants(root: ET.Element, tex: str) -> None:
    for element in root.iter():
        variant = element.attrib.get("mathvariant")
        if variant is None or variant == "normal":
            continue
        table = _VARIANTS.get(variant)
        text = element.text or ""
        missing = [c for c in text if table is None or c not in table]
        if missing or len(element) or not text:
            raise MathError(f"no Unicode letters for mathvariant={variant!r} {text!r} in {tex!r}")
        element.text = "".join(table[c] for c in text)  # type: ignore[index]
        del element.attrib["mathvariant"]


def tex_to_mathml(tex: str, display: bool) -> str:
    """One equation's MathML (``<math>`` element) or MathError.

    An error rather than a wrong formula: latex2mathml keeps a command it does not know as text
    (``\\foo`` becomes ``<mi>\\foo</mi>``), so any backslash left in the output's text fails.
    """
    from latex2mathml.converter import convert  # the docs extra; imported when a page has TeX

    try:
        mathml = convert(_prepare(tex.strip()), display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises its own exception types (and IndexError)
        raise MathError(
            f"latex2mathml cannot convert {tex!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        root = ET.fromstring(mathml)
    except ET.ParseError as exc:
        raise MathError(f"latex2mathml wrote malformed MathML for {tex!r}: {exc}") from exc
    left = [t for t in root.itertext() if "\\" in t]
    if left:
        raise MathError(f"commands left unconverted {left} in {tex!r}")
    _fix_variants(root, tex)
    return ET.tostring(root, encoding="unicode")


def convert_page(content: str) -> tuple[str, int]:
    """The page's HTML with every arithmatex equation as MathML, and how many there were."""
    count = 0

    def one(m: re.Match[str]) -> str:
        nonlocal count
        count += 1
        display = m.group("open") == "["
        mathml = tex_to_mathml(html.unescape(m.group("tex")), display)
        return f'<div class="math">{mathml}</div>' if display else mathml

    converted = _ARITHMATEX.sub(one, content)
    if 'class="arithmatex"' in converted:
        raise MathError("an arithmatex element this hook does not recognise is left in the page")
    return converted, count


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    try:
        return convert_page(html_text)[0]
    except MathError as exc:
        raise PluginError(f"{page.file.src_uri}: {exc}") from exc
