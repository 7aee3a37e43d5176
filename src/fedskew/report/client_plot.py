"""How the clients' accuracies spread, per method: a box of every client of every seed
(median, quartiles, whiskers to the farthest client within 1.5 IQR) with each client drawn
as a point over it, so that a few clients far below the rest show as themselves. The
tick labels count the points (clients x seeds)."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedskew.report.figures import label, literal_text


@literal_text
def client_accuracy_png(values: dict[str, list[float]], title: str, what: str) -> bytes:
    """A PNG of one box per method (``values``: method -> its clients' accuracies in %,
    every seed's clients together), methods across; ``what`` labels the accuracy axis."""
    names = list(values)
    fig = Figure(figsize=(min(16.0, max(5.0, 0.9 * len(names) + 2.0)), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    positions = np.arange(len(names))
    data = [np.asarray(values[n], dtype=float) for n in names]
    ax.boxplot(
        data, positions=positions, widths=0.6, showfliers=False,
        medianprops={"color": "black"}, boxprops={"color": "#555555"},
    )  # fmt: skip
    # A fixed jitter: a picture rebuilt from the same folders is the same picture.
    rng = np.random.default_rng(0)
    for i, (pos, got) in enumerate(zip(positions, data, strict=True)):
        jitter = rng.uniform(-0.18, 0.18, got.size)
        ax.scatter(pos + jitter, got, s=12, alpha=0.6, color=f"C{i % 10}", linewidths=0)
    ticks = [f"{label(n)} ({len(v)})" for n, v in zip(names, data, strict=True)]
    slanted = sum(len(t) for t in ticks) > 60
    ax.set_xticks(positions, labels=ticks, rotation=30 if slanted else 0,
                  ha="right" if slanted else "center")  # fmt: skip
    ax.set_ylim(-2, 102)
    ax.set_ylabel(label(what))
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(label(title))
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    return buf.getvalue()
