"""Pictures whose text is taken as written: the escaping of names for PNG.

Matplotlib reads the text between two ``$`` of a label as mathematics: a method, setting or
class name read from a run folder (``$\\x$``, ``a$b$c``) would be typeset, or stop the
drawing with an error. Every picture of a report is drawn with that off
(:func:`literal_text`), and every name it shows goes through :func:`label`. A legend is
given its labels rather than asked for them: Matplotlib leaves out a line whose label
starts with "_" (and a legend of none fails).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, NullFormatter

from fedskew.report.document import one_line

P = ParamSpec("P")
R = TypeVar("R")


def literal_text(draw: Callable[P, R]) -> Callable[P, R]:
    """``draw`` with every text it makes taken as plain characters (no mathematics, no
    TeX)."""

    @functools.wraps(draw)
    def drawn(*args: P.args, **kwargs: P.kwargs) -> R:
        with rc_context({"text.parse_math": False, "text.usetex": False}):
            return draw(*args, **kwargs)

    return drawn


def label(text: object) -> str:
    """A name as a picture shows it: one line, control characters blank, bidirectional
    overrides and lone surrogates (which the font renderer refuses) as U+FFFD."""
    return one_line(str(text))


def log_scale(ax: Axes, which: str) -> None:
    """A log scale on axis ``which`` ("x" or "y") whose tick labels are plain numbers:
    Matplotlib's log formatter writes them as mathematics (``$\\mathdefault{10^{-2}}$``),
    which :func:`literal_text` would show as written."""
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
