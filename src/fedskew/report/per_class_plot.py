"""The methods x classes heatmap of a setting: each method's per-class test accuracy (mean
over its seeds), the value written in each cell."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedskew.report.figures import label, literal_text

# Beyond these the figure stops writing values in the cells and naming every class.
_MAX_ANNOTATED_CELLS = 400
_MAX_CLASS_TICKS = 40


@literal_text
def per_class_png(values: np.ndarray, methods: list[str], classes: list[str], title: str) -> bytes:
    """A PNG of ``values`` ((methods, classes) accuracies in %, NaN where no run scored the
    class), rows labelled by ``methods`` and columns by ``classes``."""
    values = np.asarray(values, dtype=float)
    methods, classes = [label(m) for m in methods], [label(c) for c in classes]
    rows, cols = values.shape
    many = cols > _MAX_CLASS_TICKS
    width = min(16.0, max(6.0, 0.75 * cols + 2.5)) if not many else 16.0
    height = min(14.0, max(2.6, 0.42 * rows + 1.9))
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    # Accuracy is read against a fixed 0-100 scale, so that heatmaps of different settings
    # compare; cells without a value show the background.
    image = ax.imshow(
        np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", cmap="viridis",
        vmin=0.0, vmax=100.0,
    )  # fmt: skip
    ax.set_facecolor("#dddddd")
    fig.colorbar(image, ax=ax, label="test accuracy (%)", pad=0.01)
    ax.set_yticks(np.arange(rows), labels=methods)
    if not many:
        slanted = any(len(c) > 3 for c in classes)  # names, not numbers: slanted to fit
        ax.set_xticks(np.arange(cols), labels=classes, rotation=40 if slanted else 0,
                      ha="right" if slanted else "center")  # fmt: skip
    ax.set_xlabel("class")
    if values.size <= _MAX_ANNOTATED_CELLS:
        for (i, j), v in np.ndenumerate(values):
            text = "-" if np.isnan(v) else f"{v:.1f}"
            # Dark text on the light (high) end of viridis, light text on the dark end.
            color = "black" if not np.isnan(v) and v > 60 else "white"
            if np.isnan(v):
                color = "#555555"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color)
    if title:
        ax.set_title(label(title))
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    return buf.getvalue()
