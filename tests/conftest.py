import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

# One thread per test process (and its subprocesses): the models here are tiny, and on a
# loaded 2-core machine OpenMP's spinning threads turn seconds into minutes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import fedskew  # noqa: E402, F401  (sets CUBLAS_WORKSPACE_CONFIG before any test uses CUDA)

torch.set_num_threads(1)

REPRODUCTION = Path(__file__).resolve().parents[1] / "reproduction"


@pytest.fixture(autouse=True)
def fedskew_logger_as_it_was():
    """The fedskew logger's handlers and level put back after each test. A Flower ServerApp
    run in-process (tests/test_resume.py) gives it Flower's console handler, bound to the
    test's capture stream: later tests then got "--- Logging error ---" tracebacks on the
    stderr they check for one line."""
    logger = logging.getLogger("fedskew")
    handlers, level = logger.handlers[:], logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture(scope="module")
def reproduction_script():
    """Load a script of reproduction/ (not a package) by file name, as a module of its own
    for the test module, and forget it afterwards."""
    loaded: list[str] = []

    def load(filename: str):
        name = f"reproduction_{Path(filename).stem}_under_test"
        spec = importlib.util.spec_from_file_location(name, REPRODUCTION / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
