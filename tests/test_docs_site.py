"""The built documentation site (mkdocs build --strict) stands on its own:

- its equations show without a network: the TeX of docs/algorithms.md is MathML in the built
  HTML (docs/hooks/math.py), one <math> element per equation of the Markdown;
- no page loads a script or style sheet from outside the site;
- no relative link leaves it: repository files the docs link to (SECURITY.md, BENCHMARKS.md,
  benchmarks/results/...) are pages or files of the site (docs/hooks/repo_links.py).

Without a browser (CI has none); benchmarks/docs_offline_check.py checks the same pages in
headless Chromium with the network off."""

from __future__ import annotations

import importlib.util
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _hook():
    pytest.importorskip("mkdocs")
    pytest.importorskip("latex2mathml")
    spec = importlib.util.spec_from_file_location("docs_math_hook", ROOT / "docs/hooks/math.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _equations(markdown: str) -> tuple[int, int]:
    """Display and inline equations of a page, counted from its Markdown (outside code)."""
    kept, in_code = [], False
    for line in markdown.split("\n"):
        if re.match(r"^\s*```", line):
            in_code = not in_code
        elif not in_code:
            kept.append(re.sub(r"`[^`]*`", "", line))
    text = "\n".join(kept)
    display = re.findall(r"\$\$(.+?)\$\$", text, re.S)
    rest = re.sub(r"\$\$(.+?)\$\$", "", text, flags=re.S)
    inline = re.findall(r"(?<!\\)\$(?!\s)([^$]+?)(?<!\s)(?<!\\)\$", rest)
    assert rest.count("$") == 2 * len(inline), "a lone $ the count does not understand"
    return len(display), len(inline)


def test_unknown_command_fails_instead_of_showing_tex() -> None:
    hook = _hook()
    with pytest.raises(hook.MathError, match=r"\\foo"):
        hook.tex_to_mathml(r"a+\foo b", display=False)


def test_commands_latex2mathml_lacks_are_rewritten() -> None:
    hook = _hook()
    mathml = hook.tex_to_mathml(r"\arg\max_x p(x) + \big\|v\big\|_2^2", display=True)
    assert "\\" not in re.sub(r"<[^>]+>", "", mathml)
    assert "arg" in re.sub(r"<[^>]+>", "", mathml) and "‖" in mathml
    assert 'display="block"' in mathml


def test_letter_variants_are_unicode_letters() -> None:
    # MathML Core ignores mathvariant="script": the letters themselves must be calligraphic.
    hook = _hook()
    mathml = hook.tex_to_mathml(
        r"\mathcal D_k \subset \mathbb R, \mathbb 1, \mathbf{x}, \mathcal L", display=False
    )
    assert "mathvariant=\"script\"" not in mathml and "double-struck" not in mathml
    for letter in ("𝒟", "ℝ", "𝟙", "𝐱", "ℒ"):
        assert letter in mathml


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _hook()
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(target)],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def test_every_equation_is_mathml(site: Path) -> None:
    page = (site / "algorithms/index.html").read_text(encoding="utf-8")
    display, inline = _equations((ROOT / "docs/algorithms.md").read_text(encoding="utf-8"))
    assert display > 10 and inline > 300  # the page's size today: the count must see them
    assert page.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block"') == display
    assert page.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline"') == inline
    assert "arithmatex" not in page and "\\(" not in page and "$$" not in page


def test_no_page_loads_anything_from_outside(site: Path) -> None:
    # Scripts, style sheets, images, fonts: anything the browser fetches by itself. Plain <a>
    # links to web pages are fine.
    fetched = re.compile(
        r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=\"((?:https?:)?//[^\"]*)\"",
        re.I,
    )
    outside = {}
    for page in site.rglob("*.html"):
        found = fetched.findall(page.read_text(encoding="utf-8"))
        if found:
            outside[str(page.relative_to(site))] = found
    for sheet in site.rglob("*.css"):
        found = re.findall(r"url\(\s*['\"]?((?:https?:)?//[^)'\"]*)", sheet.read_text("utf-8"))
        if found:
            outside[str(sheet.relative_to(site))] = found
    assert not outside, outside
    assert "mathjax" not in (ROOT / "mkdocs.yml").read_text(encoding="utf-8").lower()


def test_no_link_leaves_the_site(site: Path) -> None:
    attribute = re.compile(r"\b(?:href|src)=\"([^\"]*)\"")
    broken: dict[str, list[str]] = {}
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        here = page.parent.relative_to(site).as_posix()
        for value in attribute.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", value) or value.startswith(("#", "//")):
                continue  # a web address, mailto:, data:, or an anchor of the page itself
            path = value.split("#", 1)[0].split("?", 1)[0]
            if not path:
                continue
            # A path from the site's root (the 404 page's) or from the page's folder.
            joined = posixpath.normpath(path[1:] if path.startswith("/") else f"{here}/{path}")
            target = site / joined
            if joined.startswith("..") or not (
                target.is_file() or (target / "index.html").is_file()
            ):
                broken.setdefault(str(page.relative_to(site)), []).append(value)
    assert not broken, broken
    # The files the issue names are pages of the site, reached from the home page and the
    # benchmarks page.
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="repository/SECURITY/"' in home
    assert (site / "repository/BENCHMARKS/index.html").is_file()
    assert (site / "repository/benchmarks/results/precision_throughput/index.html").is_file()
