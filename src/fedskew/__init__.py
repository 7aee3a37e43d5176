"""fedskew: federated learning under label and quantity skew.

``fedskew.run(config, algorithm=..., model=..., dataset=...)`` runs an experiment from
Python (see :mod:`fedskew.api`); the command line is ``fedskew``.
"""

import os
import sys
from typing import Any

from fedskew.version import __version__

# cuBLAS reads CUBLAS_WORKSPACE_CONFIG once per process, at its first matrix product, and
# only ":4096:8" (or ":16:8") makes its products reproducible under --deterministic. Set
# here, before this package can touch CUDA, a process that runs an ordinary CUDA run first
# and a deterministic one later still works. A value the user chose is kept. (32 MiB of
# cuBLAS workspace per handle; CPU-only runs ignore it.)
CUBLAS_AT_IMPORT = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Whether CUDA was already in use in this process before fedskew set the variable: then
# cuBLAS may have read the environment without it, and a deterministic run would fail.
_torch = sys.modules.get("torch")
CUDA_BEFORE_IMPORT = bool(
    CUBLAS_AT_IMPORT is None and _torch is not None and _torch.cuda.is_initialized()
)

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    # The API imports torch and the whole package: only when it is asked for.
    if name == "run":
        from fedskew.api import run

        return run
    raise AttributeError(f"module 'fedskew' has no attribute {name!r}")
