"""MkDocs hook: links from docs/ to repository files outside docs/ (SECURITY.md, BENCHMARKS.md,
benchmarks/results/..., reproduction/REPRODUCTION.md).

The pages keep plain relative links such as ``../SECURITY.md`` so that they work where the
Markdown is read directly (a repository browser, an editor). MkDocs builds only docs/ and would
report each such link as a page it cannot find, which fails a strict build. This hook checks
that the target exists in the repository (a missing one fails the build, as a broken link
inside docs/ does), hides it from MkDocs' link check, and then points the link at the file:
at ``repo_url/blob/HEAD/<path>`` when mkdocs.yml sets ``repo_url``, otherwise at the file
relative to the built page, which is right for a site built into the checkout's ``site/``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# A Markdown inline link or image: [text](target) with an optional "title".
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
# The placeholder has a scheme, so MkDocs leaves it alone; on_page_content replaces it.
_MARK = "fedskew-repository-file:"


def _outside_target(page_src: str, target: str) -> str | None:
    """The repository path of a relative link that leaves docs/, else None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), path))
    if joined == "docs" or joined.startswith("docs/"):
        return None
    return joined


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = Path(config["config_file_path"]).parent
    lines = markdown.split("\n")
    in_code = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code:
            continue

        def mark(m: re.Match[str]) -> str:
            target = m.group(2)
            repo_path = _outside_target(page.file.src_uri, target)
            if repo_path is None:
                return m.group(0)
            if repo_path.startswith("../") or not (root / repo_path).exists():
                raise PluginError(
                    f"{page.file.src_uri}: link {target!r} points at {repo_path}, which is not "
                    "a file of the repository"
                )
            anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
            return f"{m.group(1)}{_MARK}{repo_path}{anchor}{m.group(3)}"

        lines[i] = _LINK.sub(mark, line)
    return "\n".join(lines)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    repo_url = (config.get("repo_url") or "").rstrip("/")
    if repo_url:
        base = f"{repo_url}/blob/HEAD/"
    else:
        # The page's folder in the site, then up out of the site folder into the checkout.
        depth = page.url.rstrip("/").count("/") + 1 if page.url.rstrip("/") else 0
        if not config["use_directory_urls"] and page.url:
            depth -= 1
        base = "../" * (depth + 1)
    return html.replace(_MARK, base)
