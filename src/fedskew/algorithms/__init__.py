"""Algorithm registry: one file per algorithm, each an ``Algorithm`` subclass."""

from __future__ import annotations

from fedskew.algorithms.fedavg import FedAvg
from fedskew.errors import UsageError
from fedskew.protocol import Algorithm

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg,)}


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UsageError(
            f"unknown algorithm '{name}'; choose from: {', '.join(sorted(ALGORITHMS))}"
        ) from None
