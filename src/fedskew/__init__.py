"""fedskew: federated learning under label and quantity skew.

``fedskew.run(config, algorithm=..., model=..., dataset=...)`` runs an experiment from
Python (see :mod:`fedskew.apps.api`); the command line is ``fedskew``.
"""

from typing import Any

import fedskew.core.cuda_environment  # noqa: F401  (before anything can touch CUDA; see there)
from fedskew.core import moved_modules
from fedskew.version import __version__

moved_modules.install()  # code written against the names before the packages by layer

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    # The API imports torch and the whole package: only when it is asked for.
    if name == "run":
        from fedskew.apps.api import run

        return run
    raise AttributeError(f"module 'fedskew' has no attribute {name!r}")
