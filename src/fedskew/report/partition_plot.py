"""Picture of a partition: class counts per client and client sizes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedskew.core.errors import FedskewError
from fedskew.report.figures import label, literal_text

# Above these sizes per-cell labels and per-client ticks become unreadable clutter.
_MAX_ANNOTATED_CELLS = 200
_MAX_BARS = 200
_MAX_CLASS_TICKS = 40


@literal_text
def plot_partition(
    counts: np.ndarray, path: Path, title: str = "", class_names: list[str] | None = None
) -> None:
    """Save a PNG: heatmap of class counts per client (left), client sizes (right)."""
    path = Path(path)
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] == 0 or counts.shape[1] == 0:
        raise FedskewError(
            f"plot_partition needs a non-empty (clients, classes) matrix, got shape {counts.shape}"
        )
    num_clients, num_classes = counts.shape
    if class_names is not None and len(class_names) != num_classes:
        raise FedskewError(
            f"plot_partition: {len(class_names)} class names for {num_classes} classes"
        )
    parent = path.parent if str(path.parent) else Path(".")
    # Fail before drawing, which can take a while for thousands of clients.
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise FedskewError(f"cannot write plot {path}: directory {parent} is not writable")

    height = min(12.0, max(4.0, 0.25 * num_clients + 1.5))
    # Figure + explicit Agg canvas: no pyplot, so no global state or GUI backend.
    fig = Figure(figsize=(12.0, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax_map, ax_bar = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1]})

    image = ax_map.imshow(
        counts, aspect="auto", interpolation="nearest", cmap="viridis", origin="upper"
    )
    fig.colorbar(image, ax=ax_map, label="samples", pad=0.01)
    ax_map.set_xlabel("class")
    ax_map.set_ylabel("client")
    if num_classes <= _MAX_CLASS_TICKS:
        ax_map.set_xticks(np.arange(num_classes))
        if class_names is not None:
            ax_map.set_xticklabels([label(c) for c in class_names], rotation=45, ha="right")
    if num_clients <= 30:
        ax_map.set_yticks(np.arange(num_clients))
    if counts.size <= _MAX_ANNOTATED_CELLS:
        threshold = counts.max() / 2 if counts.max() > 0 else 1
        for (i, j), value in np.ndenumerate(counts):
            ax_map.text(
                j,
                i,
                str(int(value)),
                ha="center",
                va="center",
                fontsize=7,
                color="black" if value > threshold else "white",
            )

    sizes = counts.sum(axis=1)
    rows = np.arange(num_clients)
    if num_clients <= _MAX_BARS:
        ax_bar.barh(rows, sizes, height=0.8, color="tab:blue")
    else:
        # Thousands of bar patches are slow to draw; a filled step outline looks the same.
        edges = np.arange(num_clients + 1) - 0.5
        ax_bar.fill_betweenx(
            edges, 0, np.append(sizes, sizes[-1]), step="post", color="tab:blue", linewidth=0
        )
    ax_bar.set_xlabel("samples per client")
    ax_bar.set_ylim(num_clients - 0.5, -0.5)
    ax_bar.tick_params(axis="y", labelleft=False)

    if title:
        fig.suptitle(label(title))
    try:
        fig.savefig(path, dpi=120, format="png")
    except OSError as exc:
        raise FedskewError(f"cannot write plot {path}: {exc.strerror or exc}") from exc
