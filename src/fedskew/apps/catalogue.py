"""What ``fedskew list`` shows about the built-in algorithms, datasets and models: their names
and descriptions, read from their modules' source instead of importing them.

Importing the registries imports torch (about 1.5 s of CPU, most of ``fedskew list``'s time
before); the descriptions are string literals in the source (an algorithm class's
``name``/``description``, the ``DatasetInfo(...)`` and ``ModelInfo(...)`` entries of the
``DATASETS`` and ``MODELS`` tables). Where one cannot be read that way (source not shipped,
a description computed), the registry is imported instead: the same text, only slower.
tests/test_cli.py checks that every built-in is read from source and equals its registry."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1]  # the fedskew package's folder


class NotLiteral(Exception):
    """The source does not state the value as a literal."""


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        raise NotLiteral
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise NotLiteral from None


def _tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))


def _assigned(body: list[ast.stmt], name: str) -> ast.expr | None:
    """The value assigned to ``name`` at the top of ``body`` (``x = ...`` or ``x: T = ...``)."""
    for node in body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == name:
                return node.value
    return None


def algorithms_from_source() -> dict[str, str]:
    """Each built-in algorithm's description: ``BUILT_IN`` of fedskew/algorithms/__init__.py
    names the module, whose class with that ``name`` has the ``description``."""
    built_in: dict[str, str] = _literal(_assigned(_tree("algorithms/__init__.py").body, "BUILT_IN"))
    out: dict[str, str] = {}
    for name, module in built_in.items():
        for node in _tree(f"algorithms/{module}.py").body:
            if isinstance(node, ast.ClassDef):
                if _assigned(node.body, "name") is None:
                    continue
                if _literal(_assigned(node.body, "name")) == name:
                    out[name] = _literal(_assigned(node.body, "description"))
        if name not in out:
            raise NotLiteral(name)
    return out


def _table_from_source(relative: str, table: str, record: str) -> dict[str, str]:
    """Name and description, the first two arguments of each ``record(...)`` call in the
    value of the table ``table`` of module ``relative``."""
    value = _assigned(_tree(relative).body, table)
    if value is None:
        raise NotLiteral(table)
    calls = [
        node
        for node in ast.walk(value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == record
    ]
    if not calls or any(len(call.args) < 2 for call in calls):
        raise NotLiteral(table)
    return {_literal(call.args[0]): _literal(call.args[1]) for call in calls}


def datasets_from_source() -> dict[str, str]:
    return _table_from_source("data/datasets.py", "DATASETS", "DatasetInfo")


def models_from_source() -> dict[str, str]:
    return _table_from_source("models/__init__.py", "MODELS", "ModelInfo")


def _imported_algorithms() -> dict[str, str]:
    from fedskew.algorithms import ALGORITHMS

    return {name: cls.description for name, cls in ALGORITHMS.items()}


def _imported_datasets() -> dict[str, str]:
    from fedskew.data.datasets import DATASETS

    return {name: info.description for name, info in DATASETS.items()}


def _imported_models() -> dict[str, str]:
    from fedskew.models import MODELS

    return {name: info.description for name, info in MODELS.items()}


def _either(
    from_source: Callable[[], dict[str, str]], imported: Callable[[], dict[str, str]]
) -> dict[str, str]:
    try:
        return from_source()
    except (OSError, SyntaxError, NotLiteral):
        return imported()


def algorithms() -> dict[str, str]:
    return _either(algorithms_from_source, _imported_algorithms)


def datasets() -> dict[str, str]:
    return _either(datasets_from_source, _imported_datasets)


def models() -> dict[str, str]:
    return _either(models_from_source, _imported_models)
