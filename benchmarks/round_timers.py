"""Exclusive-time timers installed around fedskew's functions, shared by the round
profilers (round_profile.py, round_fixed_costs.py).

A :class:`Ledger` keeps a stack of categories: every wrapped call (:func:`timed`) pushes its
category, and the time between two clock readings goes to the category on top, so the
categories of a stretch of time add up to its wall time exactly (a category's nested wrapped
calls count in their own). ``sync``, where given (``torch.cuda.synchronize`` on CUDA), runs
before every clock reading: the device's queued work is then booked to the category that
queued it, not to whichever later one waits for it.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch


class Ledger:
    """Exclusive time per category: the time between two clock readings goes to the
    category on top of the stack (``base`` at the bottom: time no wrapper claims)."""

    def __init__(self, base: str = "other", sync: Callable[[], None] | None = None) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.stack = [base]
        self.sync = sync
        self.last = time.perf_counter()
        self.regions = False  # record_function regions (while torch.profiler runs)
        self.excluded = 0.0  # time kept out of every category (the interleaved bare loop)
        self.suspended = False  # inside aside(): wrapped calls book nothing

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def enter(self, category: str) -> None:
        now = self._now()
        self.totals[self.stack[-1]] += now - self.last
        self.stack.append(category)
        self.calls[category] += 1
        self.last = now

    def leave(self) -> None:
        now = self._now()
        self.totals[self.stack.pop()] += now - self.last
        self.last = now

    def snapshot(self) -> tuple[float, dict[str, float], dict[str, int]]:
        """(clock less excluded time, seconds per category, calls per category) so far."""
        now = self._now()
        self.totals[self.stack[-1]] += now - self.last
        self.last = now
        return now - self.excluded, dict(self.totals), dict(self.calls)

    def aside(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` with its time booked to no category and left out of the round."""
        now = self._now()
        self.totals[self.stack[-1]] += now - self.last
        self.suspended = True
        try:
            fn()
        finally:
            self.suspended = False
            self.last = self._now()
            self.excluded += self.last - now


def timed(ledger: Ledger, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
    """``fn`` with its time booked to ``category``; arguments and result pass unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if ledger.suspended:
            return fn(*args, **kwargs)
        ledger.enter(category)
        region = torch.profiler.record_function("fs::" + category) if ledger.regions else None
        if region is not None:
            region.__enter__()
        try:
            return fn(*args, **kwargs)
        finally:
            if region is not None:
                region.__exit__(None, None, None)
            ledger.leave()

    return wrapper


class Patches:
    """Attributes replaced by timed wrappers, put back by :meth:`restore` (in reverse)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name`` to ``new``; return the original."""
        original = getattr(owner, name)
        self.saved.append((owner, name, original))
        setattr(owner, name, new)
        return original

    def time(self, owner: Any, name: str, category: str) -> None:
        """``owner.name`` booked to ``category``."""
        self.replace(owner, name, timed(self.ledger, getattr(owner, name), category))

    def restore(self) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved.clear()
