"""fedskew: federated learning under label and quantity skew.

``fedskew.run(config, algorithm=..., model=..., dataset=...)`` runs an experiment from
Python (see :mod:`fedskew.api`); the command line is ``fedskew``.
"""

from typing import Any

import fedskew.cuda_environment  # noqa: F401  (before anything can touch CUDA; see there)
from fedskew.version import __version__

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    # The API imports torch and the whole package: only when it is asked for.
    if name == "run":
        from fedskew.api import run

        return run
    raise AttributeError(f"module 'fedskew' has no attribute {name!r}")
