"""The layers of docs/design.md, checked on the source: a module imports only
modules of its own layer or below, at module level or inside a function alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fedskew"

# Lowest first. A module is placed by the longest prefix of its dotted name listed here.
LAYERS: list[tuple[str, ...]] = [
    ("fedskew.version", "fedskew.core"),  # leaves: errors, randomness, devices, files
    ("fedskew.data", "fedskew.models", "fedskew.metrics"),
    ("fedskew.config",),  # the options, declared once
    ("fedskew.report",),  # formats run folders' files into tables, plots and documents
    ("fedskew.training",),  # what an algorithm is written against
    ("fedskew.algorithms",),
    ("fedskew.assembly",),  # an experiment's pieces from its configuration
    ("fedskew.engines",),  # carry the messages: in process, worker processes, Flower
    ("fedskew.runs",),  # the round loop, run folders, checkpoints, measurements, tracking
    ("fedskew.grid",),  # compare's grids and their executors
    # apps; the package's __init__ offers the Python API (fedskew.run)
    ("fedskew", "fedskew.apps", "fedskew.__main__"),
]


def layer_of(module: str) -> int:
    best, level = -1, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), index
    assert level >= 0, f"{module} is in no layer: add it to LAYERS"
    return level


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """fedskew modules imported anywhere in the tree (relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fedskew"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("fedskew"):
                found.add(base)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_points_up(path: Path):
    module = module_name(path)
    level = layer_of(module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    up = sorted(
        m for m in imported(tree, module, path.name == "__init__.py") if layer_of(m) > level
    )
    assert not up, f"{module} (layer {level}) imports from higher layers: {up}"


def test_the_checker_sees_an_upward_import():
    tree = ast.parse("def f():\n    from fedskew.runs.loop import run\n")
    assert layer_of("fedskew.runs.loop") > layer_of("fedskew.engines.workers")
    assert "fedskew.runs.loop" in imported(tree, "fedskew.engines.workers", False)
