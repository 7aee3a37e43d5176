"""MkDocs hook: repository files that the docs link to outside docs/ (SECURITY.md, BENCHMARKS.md,
benchmarks/results/..., reproduction/REPRODUCTION.md) become part of the site.

The pages keep plain relative links such as ``../SECURITY.md`` so that they work where the
Markdown is read directly (a repository browser, an editor). MkDocs builds only docs/; a link out
of it would leave the site (a 404 under ``mkdocs serve``, a raw file or a dead link elsewhere).
So this hook

- collects every repository file outside docs/ that a page links to, and the files those link
  to in turn (a Markdown file's links are followed, the closure is small: result tables, their
  figures, the reproduction reports), and adds each to the site under ``repository/<its path>``:
  Markdown as a page (themed, searchable, not in the nav), anything else copied as it is;
- rewrites each such link to the file's place in the site, and the links inside those files to
  their targets' places (into docs/ pages or other copied files), so that MkDocs checks them
  as it checks links between pages (a missing file or anchor fails the strict build);
- fails the build on a link to a file that does not exist, or that lies outside the repository.

tests/test_docs_site.py builds the site and checks that no link on any page leaves it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

# Where the copied repository files live in the site.
PREFIX = "repository/"

# A Markdown inline link or image: [text](target) with an optional "title".
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _targets(markdown: str) -> list[str]:
    """Link targets outside fenced code blocks."""
    found: list[str] = []
    in_code = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            found += [m.group(2) for m in _LINK.finditer(line)]
    return found


def _repo_path(origin: str, target: str) -> str | None:
    """The repository path a relative link from the file at ``origin`` points at, else None."""
    if _SCHEME.match(target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))


def _check(root: Path, origin: str, target: str, repo_path: str) -> None:
    if repo_path.startswith("../") or repo_path == "..":
        raise PluginError(f"{origin}: link {target!r} leaves the repository")
    if not (root / repo_path).is_file():
        raise PluginError(
            f"{origin}: link {target!r} points at {repo_path}, which is not a file of the "
            "repository"
        )


def outside_files(root: Path, pages: list[str]) -> list[str]:
    """Repository paths (outside docs/) reachable by links from the docs pages ``pages``
    (repository paths such as ``docs/index.md``), following links inside Markdown files."""
    found: set[str] = set()
    todo = list(pages)
    while todo:
        origin = todo.pop()
        for target in _targets((root / origin).read_text(encoding="utf-8")):
            repo_path = _repo_path(origin, target)
            if repo_path is None or repo_path.startswith("docs/"):
                continue
            _check(root, origin, target, repo_path)
            if repo_path not in found:
                found.add(repo_path)
                if repo_path.endswith(".md"):
                    todo.append(repo_path)
    return sorted(found)


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).parent


def on_files(files: Any, config: Any) -> Any:
    root = _root(config)
    docs = Path(config["docs_dir"]).resolve().relative_to(root.resolve()).as_posix()
    pages = [f"{docs}/{f.src_uri}" for f in files.documentation_pages()]
    for repo_path in outside_files(root, pages):
        files.append(File.generated(
            config, PREFIX + repo_path, abs_src_path=str(root / repo_path),
            inclusion=InclusionLevel.NOT_IN_NAV,
        ))  # fmt: skip
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = _root(config)
    docs = Path(config["docs_dir"]).resolve().relative_to(root.resolve()).as_posix()
    src = page.file.src_uri
    origin = src[len(PREFIX):] if src.startswith(PREFIX) else f"{docs}/{src}"
    here = posixpath.dirname(src)

    def retarget(m: re.Match[str]) -> str:
        target = m.group(2)
        repo_path = _repo_path(origin, target)
        if repo_path is None:
            return m.group(0)
        _check(root, origin, target, repo_path)
        if repo_path.startswith(f"{docs}/"):
            site_src = repo_path[len(docs) + 1:]
        else:
            site_src = PREFIX + repo_path
        anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
        return f"{m.group(1)}{posixpath.relpath(site_src, here or '.')}{anchor}{m.group(3)}"

    lines = markdown.split("\n")
    in_code = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines[i] = _LINK.sub(retarget, line)
    return "\n".join(lines)
