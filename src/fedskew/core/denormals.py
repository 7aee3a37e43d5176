"""Denormal floats on the CPU: flushed to zero (the default) or kept (IEEE behaviour).

Late in training many small weights, gradients and momentum entries become denormal
(below 1.2e-38 in float32), and x86 CPUs compute on those through a slow microcode path:
on the issue-6 experiment whole rounds ran about 2x slower per sample. Flushing them to zero
(the FTZ and DAZ bits of the SSE control register) removes that; a value of that size
changes nothing a float32 model can resolve, so the metrics of a flushed run differ from an
IEEE run's only by rounding (see BENCHMARKS.md). A run is still deterministic for a given
setting.

The control register is per thread, and a new thread copies it from the thread that creates
it. ``torch.set_flush_denormal`` sets it on the calling thread only, so torch's intra-op
thread pool, once started, would keep the old behaviour for its share of every kernel.
:func:`apply_denormals` therefore also sets it inside every thread of the calling thread's
OpenMP team (through the GNU OpenMP runtime torch ships with on Linux), and
:func:`denormals_state` checks what the whole pool does with a probe computation.
CUDA kernels are untouched (their flushing is a compile-time choice); the setting applies to
whatever runs on the CPU, aggregation and evaluation included.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from fedskew.core.option_values import (  # noqa: F401 (re-exported)
    DENORMALS,
    LEGACY_DENORMALS,
    check_denormals,
)

log = logging.getLogger("fedskew")

_DENORMAL_BITS = 0x000FFFFF  # a float32 denormal (about 1.5e-39): exponent bits all zero

_warned: set[str] = set()


def apply_denormals(mode: str) -> str:
    """Flush (``"flush"``) or keep (``"keep"``) denormals in this thread and every thread of
    its torch thread pool; return what the pool now does (:func:`denormals_state`):
    ``mode`` itself, or ``"unsupported"`` where this CPU cannot flush, or ``"mixed"`` where
    the pool's threads could not all be reached (warned once)."""
    mode = check_denormals(mode)
    flush = mode == "flush"
    if not torch.set_flush_denormal(flush) and flush:
        _warn_once(
            "unsupported",
            "denormals flush: this CPU or torch build cannot flush denormals; they are kept",
        )
        return "unsupported"
    _in_every_pool_thread(lambda: torch.set_flush_denormal(flush))
    state = denormals_state()
    if state != mode:
        _warn_once(
            "mixed",
            f"denormals {mode}: only some of torch's threads could be switched ({state}); "
            "start the process with fedskew before other torch work",
        )
    return state


@contextmanager
def denormals_applied(mode: str) -> Iterator[str]:
    """``mode`` in this thread and its pool for the block, the thread's previous behaviour
    put back after it; yields what the pool does inside (:func:`apply_denormals`). For code
    called from threads and processes it does not own (a ClientApp that Flower, or a test,
    calls in its own thread must not leave that thread changed). Where the thread already
    has ``mode`` (a worker process set it for its lifetime) this is one probe."""
    before = denormals_state()
    if before == check_denormals(mode):
        yield before
        return
    state = apply_denormals(mode)
    try:
        yield state
    finally:
        # A pool found mixed is put back as torch's default.
        apply_denormals("flush" if before == "flush" else "keep")


def denormals_state() -> str:
    """What this thread's torch pool does with denormal inputs, measured: ``"flush"`` (all
    threads flush), ``"keep"`` (none does) or ``"mixed"``. The probe is large enough that
    every thread of the pool takes a share of it."""
    threads = max(1, torch.get_num_threads())
    # An elementwise kernel splits at 32,768 elements a chunk (torch's grain size). The
    # denormal is written as bits: a float conversion in a flushing thread would make it 0.
    # On the CPU by name: a caller's default device (meta, CUDA) must not move the probe.
    bits = torch.full((threads * 65536,), _DENORMAL_BITS, dtype=torch.int32, device="cpu")
    kept = int(torch.count_nonzero(bits.view(torch.float32).mul_(1.0)))
    if kept == 0:
        return "flush"
    return "keep" if kept == bits.numel() else "mixed"


def _in_every_pool_thread(fn: Callable[[], object]) -> None:
    """Call ``fn`` once in every thread of the calling thread's OpenMP team (the pool torch's
    kernels run in), the calling thread included. Without GNU OpenMP (another platform or
    build) only the calling thread is reached, and denormals_state tells."""
    gomp = _gomp()
    threads = torch.get_num_threads()
    if gomp is None or threads <= 1:
        fn()
        return
    callback = _CALLBACK(lambda _data: fn())
    gomp.GOMP_parallel(callback, None, threads, 0)


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_gomp_library: ctypes.CDLL | None = None
_gomp_looked = False


def _gomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch's kernels use (torch/lib/libgomp.so.1 in Linux wheels,
    else the one already loaded into the process), or None."""
    global _gomp_library, _gomp_looked
    if _gomp_looked:
        return _gomp_library
    _gomp_looked = True
    candidates = [os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")]
    candidates.append("libgomp.so.1")
    for name in candidates:
        try:
            # RTLD_NOLOAD: only a runtime the process has loaded already (the one torch's
            # kernels run in), never a second copy with a pool of its own.
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            function = library.GOMP_parallel
        except (OSError, AttributeError):
            continue
        function.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        function.restype = None
        _gomp_library = library
        break
    return _gomp_library


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(text)
