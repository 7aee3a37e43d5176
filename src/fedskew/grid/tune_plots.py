"""The figures of a tuning study's report, as static PNGs (the HTML report embeds them;
Optuna's dashboard shows the same study live from its storage): the objective over trials
with the best so far, and one slice per tuned value (objective against that value)."""

from __future__ import annotations

import io

import optuna
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedskew.grid.search_space import Dimension
from fedskew.grid.tune import slot_of
from fedskew.report.figures import label, literal_text, log_scale

TrialState = optuna.trial.TrialState


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _last_reported(trial: optuna.trial.FrozenTrial) -> float | None:
    """A pruned trial's accuracy at the round it was stopped."""
    if not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]


def _points(
    trials: list[optuna.trial.FrozenTrial],
) -> tuple[list[optuna.trial.FrozenTrial], list[tuple[optuna.trial.FrozenTrial, float]]]:
    """The completed trials, and the pruned ones with their last reported value."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    pruned = []
    for t in trials:
        value = _last_reported(t) if t.state == TrialState.PRUNED else None
        if value is not None:
            pruned.append((t, value))
    return complete, pruned


@literal_text
def history_png(trials: list[optuna.trial.FrozenTrial], method: str) -> bytes | None:
    """Each trial's objective by trial number, the best so far as a step line; pruned trials
    hollow, at the accuracy of the round where they stopped. None without any point."""
    complete, pruned = _points(trials)
    if not complete and not pruned:
        return None
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if complete:
        ax.scatter([slot_of(t) for t in complete], [t.value for t in complete], color="C0",
                   label="complete", zorder=3)  # fmt: skip
        best, steps = None, []
        for t in sorted(complete, key=lambda t: slot_of(t)):
            best = t.value if best is None else max(best, t.value)
            steps.append((slot_of(t), best))
        ax.step([n for n, _ in steps], [b for _, b in steps], where="post", color="C1",
                label="best so far")  # fmt: skip
    if pruned:
        ax.scatter([slot_of(t) for t, _ in pruned], [v for _, v in pruned], facecolors="none",
                   edgecolors="C2", label="pruned (at its last round)", zorder=3)  # fmt: skip
    ax.set_xlabel("trial")
    ax.set_ylabel("objective: accuracy (%)")
    ax.set_title(f"{label(method)}: objective over trials")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    return _png(fig)


@literal_text
def slices_png(
    trials: list[optuna.trial.FrozenTrial], dims: list[Dimension], method: str
) -> bytes | None:
    """One panel per tuned value: the objective against the value (log axis for a log
    range), pruned trials hollow. None without any point."""
    complete, pruned = _points(trials)
    if not complete and not pruned:
        return None
    # At least as wide as the title (one panel alone would cut it).
    fig = Figure(figsize=(max(6.4, 4.0 * len(dims)), 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(dims), squeeze=False)[0]
    for ax, dim in zip(axes, dims, strict=True):
        xs = [(t.params[dim.key], t.value) for t in complete if dim.key in t.params]
        hollow = [(t.params[dim.key], v) for t, v in pruned if dim.key in t.params]
        if dim.kind == "choice":  # categories: their index, labelled with the value
            labels = [label(v) for v in dim.values]
            xs = [(labels.index(label(x)), y) for x, y in xs]
            hollow = [(labels.index(label(x)), y) for x, y in hollow]
            ax.set_xticks(range(len(labels)), labels)
        elif dim.kind == "log":
            log_scale(ax, "x")
        if xs:
            ax.scatter([x for x, _ in xs], [y for _, y in xs], color="C0", zorder=3)
        if hollow:
            ax.scatter([x for x, _ in hollow], [y for _, y in hollow], facecolors="none",
                       edgecolors="C2", zorder=3)  # fmt: skip
        ax.set_xlabel(label(dim.key))
        ax.set_ylabel("accuracy (%)")
    fig.suptitle(f"{label(method)}: objective against each tuned value (hollow: pruned)")
    return _png(fig)
