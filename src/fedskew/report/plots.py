"""Curves of a comparison: test accuracy and loss per round, every method in one plot,
the mean over seeds with a band from the lowest to the highest seed."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedskew.report.figures import label, literal_text, log_scale
from fedskew.report.run_status import DIVERGED, FAILED
from fedskew.report.runs import RunRecord


def _mean_band(series: list[list[tuple[int, float]]]) -> tuple[np.ndarray, ...] | None:
    """Rounds common to all seeds, and the mean, min and max over seeds there."""
    if not series:
        return None
    common = set.intersection(*(set(r for r, _ in s) for s in series))
    if not common:
        return None
    rounds = np.array(sorted(common))
    values = np.array([[dict(s)[r] for r in rounds] for s in series], dtype=float)
    return rounds, values.mean(0), values.min(0), values.max(0)


@literal_text
def curves_png(records: list[RunRecord], title: str = "") -> bytes | None:
    """A PNG with two panels (test accuracy in %, test loss) over rounds; None when no run
    has an evaluated round. Unfinished runs count with the rounds they have; runs that
    diverged or failed stay out of the mean, as in the tables (their rounds before the stop
    would cut every seed's curve there), and are counted in the legend."""
    by_method: dict[str, list[RunRecord]] = {}
    stopped: dict[str, list[str]] = {}  # method -> "1 diverged", "1 failed"
    for rec in records:
        by_method.setdefault(rec.method, [])
        kind = rec.status.kind
        if kind in (DIVERGED, FAILED):
            stopped.setdefault(rec.method, []).append(kind)
        else:
            by_method[rec.method].append(rec)
    fig = Figure(figsize=(11.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_acc, ax_loss = fig.subplots(1, 2)
    drawn = False
    loss_range: list[float] = []  # lowest and highest loss drawn
    handles, labels = [], []  # of the accuracy panel, for the legend
    for i, (method, recs) in enumerate(by_method.items()):
        color = f"C{i % 10}"
        for ax, key, scale in ((ax_acc, "accuracy", 100.0), (ax_loss, "loss", 1.0)):
            band = _mean_band([r.series(key) for r in recs if r.series(key)])
            if band is None:
                continue
            rounds, mean, low, high = band
            if key == "loss" and np.isfinite(high).any():
                lo, hi = float(np.nanmin(low)), float(np.nanmax(high[np.isfinite(high)]))
                loss_range[:] = (
                    [min(loss_range[0], lo), max(loss_range[1], hi)] if loss_range else [lo, hi]
                )
            n = len(recs)
            kinds = stopped.get(method, [])
            beside = "".join(f", +{kinds.count(k)} {k}" for k in (DIVERGED, FAILED) if k in kinds)
            name = label(f"{method} ({n} seed{'s' if n != 1 else ''}{beside})")
            (line,) = ax.plot(rounds, scale * mean, color=color, linewidth=1.4)
            if ax is ax_acc:
                handles.append(line)
                labels.append(name)
            if n > 1:
                ax.fill_between(rounds, scale * low, scale * high, color=color, alpha=0.15)
            drawn = True
    if not drawn:
        return None
    ax_acc.set_ylabel("test accuracy (%)")
    ax_loss.set_ylabel("test loss")
    for ax in (ax_acc, ax_loss):
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if loss_range and loss_range[0] > 0 and loss_range[1] / loss_range[0] > 20:
        log_scale(ax_loss, "y")  # a diverging method would flatten the others
    if labels:
        fig.legend(
            handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8
        )
    if title:
        fig.suptitle(label(title))
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    return buf.getvalue()


def partition_png(counts: np.ndarray, title: str, class_names: list[str] | None) -> bytes:
    """The partition heatmap of :mod:`fedskew.report.partition_plot`, as PNG bytes."""
    import tempfile
    from pathlib import Path

    from fedskew.report.partition_plot import plot_partition

    with tempfile.TemporaryDirectory(prefix="fedskew-report-") as tmp:
        path = Path(tmp) / "partition.png"
        plot_partition(counts, path, title=title, class_names=class_names)
        return path.read_bytes()
