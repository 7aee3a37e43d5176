"""Algorithm registry: the built-in algorithms by name, each imported only when it is asked
for (running FedAvg imports FedAvg's module, not the other sixteen)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping

from fedskew.core.errors import UsageError
from fedskew.core.references import entry_points, import_reference, is_reference, load_entry_point
from fedskew.training.interface import Algorithm

# name -> the module of this package that defines it. Adding an algorithm is adding its file
# and its line here; tests/test_algorithm_registry.py fails when the two disagree.
BUILT_IN: dict[str, str] = {
    "creff": "creff",
    "fedacd": "fedacd",
    "fedavg": "fedavg",
    "fedcme": "fedcme",
    "feddecorr": "feddecorr",
    "feddyn": "feddyn",
    "fedfm": "fedfm",
    "fedfm-lite": "fedfm_lite",
    "fedlc": "fedlc",
    "fednh": "fednh",
    "fednova": "fednova",
    "fedntd": "fedntd",
    "fedproto": "fedproto",
    "fedprox": "fedprox",
    "fedrod": "fedrod",
    "fedrs": "fedrs",
    "moon": "moon",
    "scaffold": "scaffold",
}


def algorithms_of(module_name: str) -> dict[str, type[Algorithm]]:
    """The named Algorithm subclasses that module ``module_name`` of this package defines."""
    module = importlib.import_module(f"{__name__}.{module_name}")
    return {
        obj.name: obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, Algorithm)
        and obj.__module__ == module.__name__
        and isinstance(getattr(obj, "name", None), str)
    }


def discover() -> dict[str, type[Algorithm]]:
    """Every algorithm the package's modules define, by importing them all (the check of
    BUILT_IN, and nothing else, needs this)."""
    found: dict[str, type[Algorithm]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        for name, cls in algorithms_of(info.name).items():
            if name in found:
                raise RuntimeError(f"two algorithms named '{name}'")
            found[name] = cls
    return dict(sorted(found.items()))


class _BuiltIn(Mapping[str, type[Algorithm]]):
    """The built-in algorithms as a read-only mapping; a module is imported at its first
    lookup. Iterating gives the names without importing anything."""

    def __getitem__(self, name: str) -> type[Algorithm]:
        module = BUILT_IN[name]  # KeyError for an unknown name, as a dict
        cls = algorithms_of(module).get(name)
        if cls is None:
            raise RuntimeError(f"fedskew.algorithms.{module} defines no algorithm '{name}'")
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(BUILT_IN)

    def __len__(self) -> int:
        return len(BUILT_IN)


ALGORITHMS: Mapping[str, type[Algorithm]] = _BuiltIn()


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
            f"algorithm '{name}' is {obj!r}, not a subclass of fedskew.training.interface.Algorithm"
        )
    missing = [attr for attr in ("name", "Params", "Server", "Client") if not hasattr(obj, attr)]
    if missing:
        raise UsageError(f"algorithm '{name}' lacks {', '.join(missing)}")
    return obj
