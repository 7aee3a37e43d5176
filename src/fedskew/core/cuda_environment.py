"""What the process environment must hold before any CUDA work, set when fedskew is imported.

cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` once per process, at its first matrix product, and
only ``:4096:8`` (or ``:16:8``) makes its products reproducible under ``--deterministic``.
Set here, before this package can touch CUDA, so that a process which runs an ordinary CUDA
run first and a deterministic one later still works. A value the user chose is kept. It
costs 32 MiB of cuBLAS workspace per handle; CPU-only runs ignore it.
"""

from __future__ import annotations

import os
import sys

CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_VALUE = ":4096:8"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")

CUBLAS_AT_IMPORT = os.environ.get(CUBLAS_VARIABLE)
os.environ.setdefault(CUBLAS_VARIABLE, CUBLAS_VALUE)

# Whether CUDA was already in use in this process before fedskew set the variable: then
# cuBLAS may have read the environment without it, and a deterministic run would fail.
_torch = sys.modules.get("torch")
CUDA_BEFORE_IMPORT = bool(
    CUBLAS_AT_IMPORT is None and _torch is not None and _torch.cuda.is_initialized()
)
