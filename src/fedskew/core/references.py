"""User code by name: ``package.module:Name`` references and installed entry points.

A run's configuration names its algorithm, model and dataset by string, so that worker
processes, Flower nodes and a resumed run find the same code again. Besides the built-in
names, a name may be an importable reference (``my_pkg.methods:FedFoo``) or the name of an
entry point that an installed package declares in the groups ``fedskew.algorithms``,
``fedskew.models`` or ``fedskew.datasets``. Objects handed to the Python API that cannot be
imported by name (defined in ``__main__`` or a function) are registered in this process
only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

from fedskew.core.errors import UsageError

GROUPS = {
    "algorithm": "fedskew.algorithms",
    "model": "fedskew.models",
    "dataset": "fedskew.datasets",
}


def is_reference(name: str) -> bool:
    return ":" in name


def import_reference(ref: str, kind: str) -> Any:
    """The object named ``module:attribute`` (dots allowed in both parts)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{kind} '{ref}': expected package.module:Name")
    # As for uvicorn's "module:app": modules of the current folder are found without
    # installing them (a console script does not put the current folder on sys.path).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{kind} '{ref}': cannot import {module_name} ({exc})") from None
    except Exception as exc:  # the user's module failed while importing
        raise UsageError(
            f"{kind} '{ref}': importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{kind} '{ref}': {module_name} has no {attr}") from None
    return obj


def entry_points(kind: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The installed entry points of ``kind`` (algorithm, model, dataset), by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUPS[kind])}


def load_entry_point(kind: str, name: str) -> Any | None:
    """The object of entry point ``name`` in ``kind``'s group, or None if none has it."""
    ep = entry_points(kind).get(name)
    if ep is None:
        return None
    try:
        return ep.load()
    except Exception as exc:
        raise UsageError(
            f"{kind} '{name}' (entry point {ep.value}) failed to load: {type(exc).__name__}: {exc}"
        ) from None


def reference_of(obj: Any) -> str | None:
    """``module:qualname`` when that name imports back to ``obj`` in a new process, else None
    (objects of ``__main__``, of a function's scope, or of a module that is not importable)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<locals>" in qualname:
        return None
    ref = f"{module}:{qualname}"
    try:
        found = import_reference(ref, "object")
    except UsageError:
        return None
    return ref if found is obj else None
