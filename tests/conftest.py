import contextlib
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

ROOT = Path(__file__).resolve().parents[1]
REPRODUCTION = ROOT / "reproduction"
BENCHMARKS = ROOT / "benchmarks"


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


@contextlib.contextmanager
def _scripts(folder: Path, prefix: str, on_path: bool):
    """A loader of the scripts of ``folder`` (not a package) by file name, each as a module
    of its own, forgotten when the block ends; ``on_path``: ``folder`` is on sys.path while
    the block runs (scripts that import their neighbours)."""
    loaded: list[str] = []

    def load(filename: str):
        name = f"{prefix}_{Path(filename).stem}_under_test"
        spec = importlib.util.spec_from_file_location(name, folder / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    if on_path:
        sys.path.insert(0, str(folder))
    try:
        yield load
    finally:
        for name in loaded:
            sys.modules.pop(name, None)
        if on_path:
            sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def reproduction_script():
    """Load a script of reproduction/ by file name, for the test module."""
    with _scripts(REPRODUCTION, "reproduction", on_path=False) as load:
        yield load


@pytest.fixture(scope="module")
def benchmark_script():
    """Load a script of benchmarks/ by file name, for the test module, with benchmarks/ on
    sys.path meanwhile (the scripts import machine.py and each other)."""
    with _scripts(BENCHMARKS, "benchmarks", on_path=True) as load:
        yield load
