"""Algorithm registry: every module of this package that defines an ``Algorithm``
subclass with a ``name`` is found here, so adding an algorithm is adding one file."""

from __future__ import annotations

import importlib
import pkgutil

from fedskew.algorithm_interface import Algorithm
from fedskew.errors import UsageError

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
    """The algorithm class; with ``feature_matching`` wrapped in FedFM's anchor matching."""
    try:
        cls = ALGORITHMS[name]
    except KeyError:
        raise UsageError(
            f"unknown algorithm '{name}'; choose from: {', '.join(ALGORITHMS)}"
        ) from None
    if feature_matching:
        from fedskew.algorithms.feature_matching import with_feature_matching

        return with_feature_matching(cls)
    return cls
