"""Algorithm registry: every module of this package that defines an ``Algorithm``
subclass with a ``name`` is found here, so adding an algorithm is adding one file."""

from __future__ import annotations

import importlib
import pkgutil

from fedskew.algorithm_interface import Algorithm
from fedskew.errors import UsageError
from fedskew.references import entry_points, import_reference, is_reference, load_entry_point

_HELPERS = {"local", "feature_matching"}  # modules that hold no algorithm of their own


def _discover() -> dict[str, type[Algorithm]]:
    found: dict[str, type[Algorithm]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in _HELPERS:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, Algorithm)
                and obj.__module__ == module.__name__
                and isinstance(getattr(obj, "name", None), str)
            ):
                if obj.name in found:
                    raise RuntimeError(f"two algorithms named '{obj.name}'")
                found[obj.name] = obj
    return dict(sorted(found.items()))


ALGORITHMS: dict[str, type[Algorithm]] = _discover()


def get_algorithm(name: str, feature_matching: bool = False) -> type[Algorithm]:
    """The algorithm class: a built-in name, a ``module:Class`` reference, an installed
    entry point (group ``fedskew.algorithms``) or one registered in this process; with
    ``feature_matching`` wrapped in FedFM's anchor matching."""
    cls = ALGORITHMS.get(name) or _REGISTERED.get(name)
    if cls is None:
        found = (
            import_reference(name, "algorithm")
            if is_reference(name)
            else load_entry_point("algorithm", name)
        )
        if found is None:
            extra = sorted(entry_points("algorithm"))
            raise UsageError(
                f"unknown algorithm '{name}'; choose from: {', '.join([*ALGORITHMS, *extra])}, "
                "or give package.module:Class"
            )
        cls = check_algorithm_class(found, name)
    if feature_matching:
        from fedskew.algorithms.feature_matching import with_feature_matching

        return with_feature_matching(cls)
    return cls


_REGISTERED: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str, cls: type[Algorithm]) -> None:
    """Make ``cls`` known as ``name`` in this process (the Python API does this for classes
    that cannot be imported by name)."""
    _REGISTERED[name] = check_algorithm_class(cls, name)


def check_algorithm_class(obj: object, name: str) -> type[Algorithm]:
    """``obj`` if it is a complete algorithm class, else a one-line UsageError."""
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise UsageError(
            f"algorithm '{name}' is {obj!r}, not a subclass of "
            "fedskew.algorithm_interface.Algorithm"
        )
    missing = [attr for attr in ("name", "Params", "Server", "Client") if not hasattr(obj, attr)]
    if missing:
        raise UsageError(f"algorithm '{name}' lacks {', '.join(missing)}")
    return obj
