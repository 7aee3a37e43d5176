"""The module names fedskew had before its modules moved into packages by layer.

Code written against an earlier fedskew (an own algorithm importing
``fedskew.algorithm_interface``, a Flower app naming ``fedskew.flower_app:server_app``) keeps
working: importing an old name gives the module that now holds its contents, with a
DeprecationWarning naming the new place. A module that was split answers for the names of
all its parts.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

# old name -> the module(s) now holding its contents
MOVED: dict[str, tuple[str, ...]] = {
    "fedskew.errors": ("fedskew.core.errors",),
    "fedskew.rng": ("fedskew.core.rng",),
    "fedskew.precision": ("fedskew.core.precision",),
    "fedskew.device": ("fedskew.core.device",),
    "fedskew.cuda_environment": ("fedskew.core.cuda_environment",),
    "fedskew.machine": ("fedskew.core.machine",),
    "fedskew.progress": ("fedskew.core.progress",),
    "fedskew.references": ("fedskew.core.references",),
    "fedskew.durable": ("fedskew.core.durable",),
    "fedskew.locks": ("fedskew.core.locks",),
    "fedskew.protocol": ("fedskew.training.protocol",),
    "fedskew.algorithm_interface": ("fedskew.training.interface",),
    "fedskew.algorithms.local": ("fedskew.training.local", "fedskew.training.aggregation"),
    "fedskew.building": ("fedskew.assembly.prepare",),
    "fedskew.engine": ("fedskew.engines",),
    "fedskew.experiment": ("fedskew.runs.loop",),
    "fedskew.checkpoint": ("fedskew.runs.checkpoint",),
    "fedskew.runfolder": ("fedskew.runs.folder",),
    "fedskew.measurements": ("fedskew.runs.measurements",),
    "fedskew.tracking": ("fedskew.runs.tracking",),
    "fedskew.grid_executors": ("fedskew.grid.executors",),
    "fedskew.api": ("fedskew.apps.api",),
    "fedskew.cli": ("fedskew.apps.cli",),
    "fedskew.options": ("fedskew.apps.options",),
    "fedskew.options_reference": ("fedskew.apps.options_reference",),
    "fedskew.compare": ("fedskew.apps.compare",),
    "fedskew.reporting": ("fedskew.apps.reporting",),
    "fedskew.flower_app": ("fedskew.apps.flower",),
}


def new_names(old: str) -> tuple[str, ...] | None:
    """Where old module ``old`` lives now (a submodule of a moved package included), or None
    when it did not move."""
    for name, targets in MOVED.items():
        if old == name:
            return targets
        if old.startswith(name + ".") and len(targets) == 1:
            return (targets[0] + old[len(name) :],)
    return None


class _Parts(types.ModuleType):
    """A split module's old name: its attributes are looked up in its parts, in order."""

    def __init__(self, name: str, parts: Sequence[types.ModuleType]) -> None:
        super().__init__(name)
        self._parts = tuple(parts)

    def __getattr__(self, attr: str) -> Any:
        for part in self._parts:
            if hasattr(part, attr):
                return getattr(part, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, targets: tuple[str, ...]) -> None:
        self.old, self.targets = old, targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{self.old} moved to {' and '.join(self.targets)}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        parts = [importlib.import_module(t) for t in self.targets]
        if len(parts) > 1:
            return _Parts(self.old, parts)
        self._spec = parts[0].__spec__  # the import machinery overwrites it with the alias's
        return parts[0]

    def exec_module(self, module: types.ModuleType) -> None:
        # The module is the moved one, already executed: only its own spec is put back.
        if not isinstance(module, _Parts):
            module.__spec__ = self._spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        targets = new_names(fullname) if fullname.startswith("fedskew.") else None
        if targets is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(fullname, targets))


def install() -> None:
    """Answer imports of the old names (once per interpreter)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder: a moved package's
        # submodules would otherwise run a second time under the old name
