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
from pathlib import Path
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
    except ModuleNotFoundError as exc:
        if _is_the_module(exc.name, module_name):
            raise UsageError(f"{kind} '{ref}': {not_found(module_name, attr)}") from None
        # The module is there; something it imports is not.
        raise UsageError(
            f"{kind} '{ref}': importing {module_name} failed: ModuleNotFoundError: {exc}"
        ) from None
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


def _is_the_module(missing: str | None, module_name: str) -> bool:
    """Whether the module Python could not find is ``module_name`` or a package of it
    (rather than one that ``module_name`` imports)."""
    return missing is not None and (module_name + ".").startswith(missing + ".")


def not_found(module_name: str, attr: str) -> str:
    """Why ``module_name`` was not found and what finds it: modules are looked up in the
    working folder and on PYTHONPATH, never by file path. Where the working folder has a
    file of that name one or two folders down, the hint names its folder."""
    cwd = Path.cwd()
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name)
        folder = path.parent.as_posix() if path.parent != Path(".") else "."
        return (
            f"{module_name} is a file path, not a module name: give the module "
            f"({path.stem}:{attr}) and put its folder on PYTHONPATH (PYTHONPATH={folder})"
        )
    top, *rest = module_name.split(".")
    hint = (
        f"no module {module_name} in the working folder ({cwd}) or on PYTHONPATH; run "
        f"fedskew in the folder that holds {top}.py or {top}/, or add that folder to PYTHONPATH"
    )
    found = _nearby(cwd, top)
    if found is not None:
        hint += f" ({found.as_posix()} is here: PYTHONPATH={found.parent.as_posix()})"
    return hint


def _nearby(cwd: Path, top: str) -> Path | None:
    """A module file ``top.py`` or package ``top/`` one or two folders below ``cwd``, as a
    path relative to it; None where there is none (or the folders cannot be read)."""
    for pattern in (f"*/{top}.py", f"*/{top}/__init__.py", f"*/*/{top}.py"):
        try:
            for path in sorted(cwd.glob(pattern)):
                if not any(part.startswith(".") for part in path.relative_to(cwd).parts):
                    found = path.relative_to(cwd)
                    return found.parent if found.name == "__init__.py" else found
        except OSError:
            return None
    return None


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
