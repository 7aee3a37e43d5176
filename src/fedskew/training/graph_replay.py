"""Warm-up, capture and replay of a graph-safe step as CUDA graphs, one graph per shape.

A step is graph-safe when it reads static tensors, writes its state in place, reads nothing
back to the host and issues the same operators on the same shapes every time
(``graph_step.py`` says why each matters). Such a step, given as a function of a key that
names its shapes (one client's batch size; a fused chunk's number of active clients and
batch width), is replayed here: its first ``WARMUP_STEPS`` runs of a key are eager on a side
stream (cuDNN chooses its algorithms and the caching allocator makes its first allocations
outside the graph), the next is captured and replayed, and the later ones are replays. The
graphs of one driver share a memory pool (they never run at once). A capture that fails
(an operator that reads back to the host, a data-dependent shape) is said once per reason,
and the step runs eagerly from then on: a capture records kernels without running them, so
the state is as it was before it.

Used by :class:`~fedskew.training.graph_step.LocalStep` (one client) and the together
engine's chunk step (``engines/together.py``, a round's clients stacked or fused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger("fedskew")

# Full-size steps run eagerly before the capture: the first (momentum starts as SGD starts
# it, a copy of the step) and one more, so that cuDNN's algorithm choice and the caching
# allocator's first allocations happen outside the graph.
WARMUP_STEPS = 2
_said: set[str] = set()  # reasons for eager steps on CUDA, logged once per process


def say_once(reason: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` (with ``%s`` for the reason) the first time ``reason`` comes up."""
    if reason not in _said:
        _said.add(reason)
        log.log(level, message, reason)


class GraphReplay:
    """Runs ``body(key)`` as a replayed CUDA graph per key (see the module's docstring).

    ``what`` names the step in the one line a failed capture logs; ``on_failure`` runs
    after a failed capture, before the step runs eagerly (to drop what the capture's run
    of the body left on the Python side)."""

    def __init__(
        self,
        device: torch.device,
        body: Callable[[Any], None],
        what: str,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self.body = body
        self.what = what
        self.on_failure = on_failure
        self.on = True  # False once a capture failed: eager from then on
        self.reason = ""  # why capture was given up, when it was
        self.graphs: dict[Hashable, Any] = {}  # key -> torch.cuda.CUDAGraph
        self.warm: dict[Hashable, int] = {}
        self.side: Any = None  # the warm-up stream
        self.pool: Any = None  # the graphs' memory pool, shared by the keys

    def run(self, key: Hashable) -> None:
        """The step of ``key``: a replay where its graph exists, else a warm-up step or the
        capture (followed by its first replay); eager once a capture failed."""
        if not self.on:
            self.body(key)
            return
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.warm.get(key, 0) < WARMUP_STEPS:
            self.warm[key] = self.warm.get(key, 0) + 1
            self.on_side_stream(key)
            return
        self.capture(key)

    def on_side_stream(self, key: Hashable) -> None:
        """An eager step on a side stream, as capture wants its warm-up (CUDA only)."""
        if self.side is None:
            self.side = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            self.body(key)
        current.wait_stream(self.side)

    def capture(self, key: Hashable) -> None:
        """Capture the step of ``key`` and replay it for this step; on failure say why and
        go on eagerly."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.body(key)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back, said once
            torch.cuda.synchronize(self.device)
            self.on = False
            self.reason = f"capture failed: {type(exc).__name__}: {exc}".splitlines()[0]
            say_once(self.reason, f"CUDA graph of {self.what}: %s; eager steps")
            if self.on_failure is not None:
                self.on_failure()
            self.body(key)
            return
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        graph.replay()
