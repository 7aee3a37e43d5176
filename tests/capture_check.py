"""What a CUDA graph capture needs of a step, checked on the CPU (tests of the graph-safe
steps: tests/test_graph_step.py for one client, tests/test_chunk_graph.py for clients trained
together).

A CUDA graph replays the kernels recorded once, on the memory they used then. On the CPU that
is checked by what a capture would see: two consecutive steps dispatch the same aten operators
on the same shapes and dtypes (no Python branch on a value, no shape that changes), every
tensor the step reads or changes across steps keeps its memory, and no tensor made during a
step outlives it except in that memory (state rebound to a new tensor is invisible to a
replay).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Record(TorchDispatchMode):
    """Each dispatched operator with its inputs' shapes and dtypes, and a weak reference to
    each tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        shapes = tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
            for a in (*args, *kwargs.values())
        )
        self.ops.append((str(func), shapes))
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out


def recorded(step, static: list[torch.Tensor]) -> tuple[list[tuple], list[tuple]]:  # type: ignore[no-untyped-def]
    """The operators of one call of ``step``, and the tensors made during it that are still
    alive after it outside the memory of ``static`` (shape, dtype)."""
    record = Record()
    with record:
        step()
    gc.collect()
    homes = {t.untyped_storage().data_ptr() for t in static}
    alive = [ref() for ref in record.made]
    left = [
        (tuple(t.shape), t.dtype)
        for t in alive
        if t is not None and t.untyped_storage().data_ptr() not in homes
    ]
    return record.ops, left
