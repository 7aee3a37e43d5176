"""What ``fedskew tune`` leaves in its folder: ``tune.json`` (budget, search space, seeds,
objective and each method's best trial), ``tuned.json`` (a compare file of the tuned methods,
to evaluate them on the evaluation seeds) and ``tune_report.md`` / ``.html``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna

from fedskew.core.durable import write_bytes_durably
from fedskew.grid.plan import merge, typed_values
from fedskew.grid.tune import (
    TrialState,
    Tune,
    held,
    redacted,
    slot_of,
    step_round,
    trial_folders,
    trial_mark,
)
from fedskew.grid.tune_plots import history_png, slices_png
from fedskew.report.document import (
    Block,
    Bold,
    Heading,
    Image,
    Mono,
    Para,
    Span,
    Table,
    write_report,
)

TUNED_FILE = "tuned.json"
RECORD_FILE = "tune.json"
# Below this many completed trials fANOVA's importances are shown with a caution: its random
# forest fits one tree point per completed trial, and with a handful of points the ranking
# moves with each new trial (an importance is a share of variance over the points it has).
IMPORTANCE_TRIALS = 10


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    complete = [t for t in held(study.get_trials(deepcopy=False)).values()
                if t.state == TrialState.COMPLETE]  # fmt: skip
    return max(complete, key=lambda t: (t.value, -slot_of(t))) if complete else None


def tuned_compare(tune: Tune, studies: dict[str, optuna.Study]) -> dict[str, Any]:
    """The compare file of the tuned methods: the tune file's experiment and [compare]
    table (its evaluation seeds), each method with its best trial's values put in. Its
    ``last`` is the objective's window, so that the evaluation reports on the test set the
    same rounds the trials were selected on (on their validation split)."""
    methods = {}
    for method, study in studies.items():
        best = best_trial(study)
        if best is not None:
            methods[method] = merge(tune.grid.methods[method], typed_values(best.params, method))
    compare = {k: v for k, v in tune.raw_compare.items() if k.replace("-", "_") != "out_dir"}
    compare.update(seeds=tune.eval_seeds, last=tune.last, out_dir=str(tune.out_dir / "evaluation"))
    return {"compare": compare, "experiment": tune.grid.base, "methods": methods}


def record(tune: Tune, studies: dict[str, optuna.Study]) -> dict[str, Any]:
    """Budget, search space, seeds, objective and results, as tune.json holds them."""
    results = {}
    for method, study in studies.items():
        trials = list(held(study.get_trials(deepcopy=False)).values())
        states = [t.state.name.lower() for t in trials]
        best = best_trial(study)
        results[method] = {
            "study": tune.study_name(method),
            "trials": {s: states.count(s) for s in sorted(set(states))},
            # [tuning seed, round] where each pruned trial stopped, by trial (slot) number
            "pruned_at": {
                str(slot_of(t)): list(found)
                for t in trials
                if t.state == TrialState.PRUNED
                and (found := last_round(tune, method, t)) is not None
            },
            "marked": {str(slot_of(t)): mark for t in trials if (mark := trial_mark(t))},
            "best_value": None if best is None else best.value,
            "best_trial": None if best is None else slot_of(best),
            "best_params": None if best is None else best.params,
            "best_folders": None
            if best is None
            else list(trial_folders(tune, method, best.user_attrs["folder"]).values()),
        }
    return {
        "study": tune.study,
        "source": tune.source,
        "storage": redacted(tune.storage),
        "trials_per_method": tune.trials,
        "tuning_seeds": tune.seeds,
        "evaluation_seeds": tune.eval_seeds,
        "objective": f"mean accuracy (%) on the validation split of {objective_window(tune)}, "
        "averaged over the tuning seeds",
        "last": tune.last,
        # What the objective scores: each client's stratified validation part of its training
        # data (every trial's config.json, resolved.validation_split, records its sizes and
        # digest); the test set is only scored by the evaluation (tuned.json).
        "validation": {
            "fraction": tune.validation,
            "per_client": True,
            "seed": "the tuning seed of each trial",
        },
        "pruner_judges_from": "pruner_warmup rounds after the round by which the trial's "
        "last declared mechanism first acted",
        "sampler": tune.sampler,
        "sampler_seed": tune.sampler_seed,
        "batch": tune.batch,
        "pruner": tune.pruner,
        "pruner_warmup": tune.pruner_warmup,
        "pruner_startup": tune.pruner_startup,
        "search_space": {
            m: {k: v for d in dims for k, v in d.as_dict().items()}
            for m, dims in tune.spaces.items()
        },
        "results": results,
    }


def objective_window(tune: Tune) -> str:
    """What the objective averages, as a run's rounds allow: "the last k evaluated rounds"
    with k = min(last, evaluated rounds), so a short study does not claim 10 rounds."""
    counts = set()
    for runs in tune.runs.values():
        for planned in runs.values():
            cfg = planned.cfg
            evaluated = sum(
                1 for r in range(cfg.rounds) if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds
            )
            counts.add(min(tune.last, evaluated))
    if len(counts) == 1:
        (k,) = counts
        every = " (every evaluated round of the runs)" if k < tune.last else ""
        return f"the last {k} evaluated rounds{every}"
    return f"the last {tune.last} evaluated rounds (fewer where a method's runs evaluate fewer)"


def storage_text(tune: Tune) -> str:
    """The storage as files and reports name it: the default SQLite file by its place in the
    study's folder (its absolute path says only where the study first ran), else the URL
    without its password."""
    name = Path(tune.out_dir).name
    if tune.storage.startswith("sqlite:///") and tune.storage.endswith(f"/{name}/study.db"):
        return "SQLite, study.db in the study's folder"
    return redacted(tune.storage)


def budget_lines(tune: Tune) -> list[str]:
    """The budget and search space, as tune prints them before it starts."""
    lines = [
        f"study {tune.study} in {tune.out_dir} (storage {storage_text(tune)}): "
        f"{tune.trials} trials per method, tuning seeds {tune.seeds}, evaluation seeds "
        f"{tune.eval_seeds}; objective: mean accuracy on a {tune.validation:g} validation "
        f"split of every client's training data, {objective_window(tune)}; "
        f"{tune.sampler} sampler (seed {tune.sampler_seed}), {pruner_text(tune)}"
    ]
    for method, dims in tune.spaces.items():
        lines.append(f"  {method}: " + "; ".join(d.describe() for d in dims))
    return lines


def pruner_text(tune: Tune) -> str:
    """The pruner and when it may first stop a trial."""
    if tune.pruner == "none":
        return "no pruner"
    after = (f"from {tune.pruner_warmup} rounds after the round in which a trial's last "
             "mechanism first acted")  # fmt: skip
    if tune.pruner == "median":
        after += f", once {tune.pruner_startup} trials completed"
    return f"pruner {tune.pruner} ({after})"


def last_round(tune: Tune, method: str, trial: optuna.trial.FrozenTrial) -> tuple[int, int] | None:
    """(tuning seed, round) of a trial's last reported round; None without any."""
    if not trial.intermediate_values:
        return None
    return step_round(tune, method, max(trial.intermediate_values))


def stopped_at(tune: Tune, method: str, trial: optuna.trial.FrozenTrial) -> str:
    """Where a pruned trial stopped: its last reported round (and seed, with several)."""
    found = last_round(tune, method, trial)
    if found is None:
        return ""
    seed, rnd = found
    return f" (round {rnd}{f' of seed {seed}' if len(tune.seeds) > 1 else ''})"


def importance(study: optuna.Study, params: int) -> dict[str, float] | None:
    """Optuna's parameter importances, None when there is too little to compute them."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if params < 2 or len(complete) < 2:
        return None
    try:
        return optuna.importance.get_param_importances(study)
    except Exception:  # noqa: BLE001 - too few distinct values, one-valued params, ...
        return None


def importance_caution(study: optuna.Study) -> str:
    """A line under the importances when too few trials completed for them to be stable."""
    n = len([t for t in held(study.get_trials(deepcopy=False)).values()
             if t.state == TrialState.COMPLETE])  # fmt: skip
    if n >= IMPORTANCE_TRIALS:
        return ""
    return (f"Caution: from {n} completed trials only (fewer than {IMPORTANCE_TRIALS}); "
            "fANOVA fits its forest to one point per completed trial, so with this few the "
            "ranking can change with the next trial.")  # fmt: skip


def report_blocks(tune: Tune, studies: dict[str, optuna.Study]) -> list[Block]:
    blocks: list[Block] = [Heading(1, f"Tuning study {tune.study}")]
    blocks += [Para(line.strip()) for line in budget_lines(tune)]
    for method, study in studies.items():
        blocks.append(Heading(2, method))
        best = best_trial(study)
        if best is None:  # the trials' table still says how each ended
            blocks.append(Para(f"No trial completed ({why_none(study)}): nothing tuned."))
        else:
            shown: list[Span] = ["Best: ", Bold(f"{best.value:.2f} %"),
                                 f" (trial {slot_of(best)}): "]  # fmt: skip
            for i, (k, v) in enumerate(best.params.items()):
                shown += [", " if i else "", Mono(k), f" = {_cell(v)}"]
            blocks.append(Para([*shown, "."]))
        keys = [d.key for d in tune.spaces[method]]
        trials = list(held(study.get_trials(deepcopy=False)).values())
        rows, so_far = [], None
        for t in trials:
            if t.state not in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                continue
            if t.state == TrialState.COMPLETE and (so_far is None or t.value > so_far):
                so_far = t.value
            value = f"{t.value:.2f}" if t.value is not None else ""
            best_cell = "" if so_far is None else f"{so_far:.2f}"
            params = [_cell(t.params.get(k)) for k in keys]
            state = t.state.name.lower()
            if t.state == TrialState.PRUNED:
                state += stopped_at(tune, method, t)
            if mark := trial_mark(t):
                state += f", {mark}"
            rows.append([str(slot_of(t)), state, value, best_cell, *params])
        blocks.append(Table(["trial", "state", "value (%)", "best so far (%)", *keys], rows))
        history = history_png(trials, method)
        if history is not None:
            blocks.append(Image(f"tune_{method}_history.png", history,
                                f"{method}: objective over trials, best so far"))  # fmt: skip
        slices = slices_png(trials, tune.spaces[method], method)
        if slices is not None:
            blocks.append(Image(f"tune_{method}_slices.png", slices,
                                f"{method}: objective against each tuned value"))  # fmt: skip
        found = importance(study, len(keys))
        if found:
            blocks.append(Para("Parameter importance (Optuna, fANOVA):"))
            blocks.append(Table(["parameter", "importance"],
                                [[k, f"{v:.3f}"] for k, v in found.items()]))  # fmt: skip
            if caution := importance_caution(study):
                blocks.append(Para(caution))
    return blocks


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def why_none(study: optuna.Study) -> str:
    """Why a study has no completed trial: its trials by state, and the first error."""
    trials = list(held(study.get_trials(deepcopy=False)).values())
    if not trials:
        return "no trial ran"
    states = [t.state.name.lower() for t in trials]
    counts = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
    errors = [t.user_attrs["error"] for t in trials if "error" in t.user_attrs]
    return counts + (f"; first error: {errors[0]}" if errors else "")


def write_results(tune: Tune, studies: dict[str, optuna.Study], tuned: bool = True) -> list[Path]:
    """tune.json, tuned.json (unless ``tuned`` is False: a method has no completed trial, and
    a compare file without it, or with its untuned defaults, would look like a result) and
    the report; returns their paths."""
    out = tune.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    files = [(RECORD_FILE, record(tune, studies))]
    if tuned:
        files.append((TUNED_FILE, tuned_compare(tune, studies)))
    for name, data in files:
        path = out / name
        write_bytes_durably(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
        paths.append(path)
    md, page = write_report(report_blocks(tune, studies), out, "tune_report",
                            f"Tuning study {tune.study}")  # fmt: skip
    return [*paths, md, page]
