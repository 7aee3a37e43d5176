"""Picture of a t-SNE of features: one point per test sample, coloured by its class
(FedFM's Fig. 6)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedskew.core.durable import write_bytes_durably
from fedskew.core.errors import FedskewError
from fedskew.report.figures import label, literal_text

_MAX_LEGEND = 20  # more classes than this get a colour bar instead of a legend


@literal_text
def plot_tsne(
    coords: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    path: Path,
    title: str = "",
    class_names: list[str] | None = None,
) -> None:
    """Save a PNG scatter of 2-D ``coords`` coloured by ``labels`` (written durably)."""
    coords, labels = np.asarray(coords), np.asarray(labels)
    if coords.ndim != 2 or coords.shape[1] != 2 or len(coords) != len(labels):
        raise FedskewError(
            f"plot_tsne needs (N, 2) coordinates and N labels, got {coords.shape} and "
            f"{labels.shape}"
        )
    fig = Figure(figsize=(7.5, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if num_classes <= 10:
        cmap, colours = colormaps["tab10"], np.arange(num_classes)
    elif num_classes <= 20:
        cmap, colours = colormaps["tab20"], np.arange(num_classes)
    else:
        cmap, colours = colormaps["turbo"], np.linspace(0, 1, num_classes)
    for c in range(num_classes):
        mask = labels == c
        if not mask.any():
            continue
        name = class_names[c] if class_names is not None and c < len(class_names) else str(c)
        ax.scatter(
            coords[mask, 0],
            coords[mask, 1],
            s=6,
            color=cmap(colours[c]),
            label=label(name),
            alpha=0.8,
            linewidths=0,
        )
    if num_classes <= _MAX_LEGEND:
        ax.legend(
            markerscale=3,
            fontsize="small",
            frameon=False,
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
        )
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(label(title), fontsize="medium")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    try:
        write_bytes_durably(Path(path), buffer.getvalue())
    except OSError as exc:
        raise FedskewError(f"cannot write plot {path}: {exc.strerror or exc}") from None
