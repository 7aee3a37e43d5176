"""``fedskew tune``: each method of a compare file tuned by Optuna over its search space, with
the same trial budget for every method, on tuning seeds kept apart from the evaluation seeds.

Every trial is an ordinary run folder per tuning seed, ``<out>/trials/<method>-t<N>-s<seed>``,
built by compare's own planning (:func:`fedskew.grid.plan.plan`) with the trial's values put
in; the objective is the mean accuracy (%) of the last ``last`` evaluated rounds, averaged over
the tuning seeds. One Optuna study per method (``<study>.<method>``) lives in relational
storage (SQLite in the tune folder by default), so a killed ``tune`` continues where it was and
several ``tune`` processes can share a study:

* a process holds a lock file per trial while it runs it (``<out>/.tune-locks/``); a trial
  left RUNNING whose lock no live process holds was cut off by a kill: the next process marks
  it FAIL and enqueues its parameters again, with its folder name, so the new trial resumes
  that trial's run folders from their last checkpoint instead of starting over;
* asking for a trial, counting the budget and the stale check happen under one lock per
  study, so two processes never exceed the budget and never both resume one folder;
* each trial holds a budget slot (a retry its stale trial's), and slot k is drawn and judged
  against the finished trials of the slots before its batch only, so a study is the same
  whether it was killed and continued or run by several processes;
* a study stores what it was made from and refuses to continue under another tune file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from fedskew.assembly.prepare import all_acted_round
from fedskew.config import ExperimentConfig, build_config, config_differences, config_hash
from fedskew.core.errors import Diverged, FedskewError, UsageError
from fedskew.core.locks import Busy, holder, lock, unlock
from fedskew.grid.plan import Grid, PlannedRun, grid_from, plan
from fedskew.grid.plan import _check_name as check_name
from fedskew.grid.search_space import Dimension, check_space, read_space, suggest, with_values
from fedskew.report.runs import INCOMPLETE
from fedskew.runs.folder import RunFolder, saved_config
from fedskew.runs.loop import run

TUNE_KEYS = ("trials", "seeds", "last", "validation", "pruner", "pruner_warmup",
             "pruner_startup", "sampler", "sampler_seed", "batch", "storage", "study",
             "out_dir")  # fmt: skip
# The fraction of every client's training data a trial holds out to score on (the objective):
# FedFM's authors hold out 20 % per client; see docs/tuning.md.
DEFAULT_VALIDATION = 0.2
# Rounds after a trial's last mechanism first acted before the pruner may judge it: from
# benchmarks/results/tune_rank_correlation.md (Spearman of that round's accuracy against the
# objective >= 0.8 for FedAvg and FedFM, and so is its mean over the later rounds).
DEFAULT_WARMUP = 4
# A completed trial scoring at most this multiple of chance (100 / classes %) is marked: the
# model learned next to nothing (too small or too large a step), and its value is not a
# measure of the method.
CHANCE_FACTOR = 1.5
# Options a trial's pruner steps are counted in: tuning them would number the same step
# differently in two trials.
STEP_KEYS = ("rounds",)
PRUNERS = ("median", "successive-halving", "none")
SAMPLERS = ("tpe", "random")
LOCKS = ".tune-locks"
# How long a process waits before it looks again at a study whose earlier batch still runs in
# another process (seconds).
POLL = 0.5
TrialState = optuna.trial.TrialState


@dataclass
class Tune:
    """A tuning study: what is tuned, on which seeds, with which budget, and where."""

    study: str
    out_dir: Path
    trials: int  # per method
    seeds: list[int]  # tuning seeds
    eval_seeds: list[int]  # [compare] seeds: the tuned compare file's
    last: int  # objective: mean accuracy of the last `last` evaluated rounds
    pruner: str
    sampler: str
    sampler_seed: int
    storage: str
    spaces: dict[str, list[Dimension]]
    runs: dict[str, dict[int, PlannedRun]]  # method -> tuning seed -> its planned run
    grid: Grid = field(repr=False)  # the evaluation grid (base, methods, [compare] options)
    raw_compare: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    # The pruner sees a trial's rounds only from pruner_warmup rounds after the round in which
    # its last declared mechanism first acted (``judged_from``), in every tuning seed, and the
    # median pruner judges only once pruner_startup trials have completed. So a trial is
    # compared at a round only with trials that were then in the same phase (all mechanisms
    # acting for at least the warm-up), never a FedFM trial that just switched matching on
    # with one that has not.
    pruner_warmup: int = DEFAULT_WARMUP
    pruner_startup: int = 5
    # Fraction of every client's training data held out as the trials' validation split
    # (the objective scores it; the test set is never scored during tuning).
    validation: float = DEFAULT_VALIDATION
    # Trials drawn from the same history: slot k draws (and is judged by the pruner) against
    # the trials of the slots before ``k - k % batch`` only, so `batch` processes can run a
    # batch at once and the study is the same whatever ran it when.
    batch: int = 1

    @property
    def trials_dir(self) -> Path:
        return self.out_dir / "trials"

    def study_name(self, method: str) -> str:
        return f"{self.study}.{method}"


class Pruned(Exception):
    """Raised from a run's on_round when Optuna's pruner stops the trial."""


# ------------------------------------------------------------------ reading a tune file


def tune_from(
    raw: dict[str, Any],
    source: str,
    cli_base: dict[str, Any],
    methods: list[str] | None,
    overrides: dict[str, Any],
) -> Tune:
    """The study of a compare file with a [tune] table and [methods.NAME.search] tables;
    ``overrides`` are [tune] keys from the command line (None: not given)."""
    where = source or "the command line"
    conf_raw = raw.get("tune")
    if not isinstance(conf_raw, dict):
        raise UsageError(f"{where}: fedskew tune needs a [tune] table (trials, seeds, ...)")
    unknown = [k for k in conf_raw if k.replace("-", "_") not in TUNE_KEYS]
    if unknown:
        raise UsageError(
            f"{where}: [tune] has no key '{unknown[0]}' (valid: {', '.join(TUNE_KEYS)})"
        )
    conf = {k.replace("-", "_"): v for k, v in conf_raw.items()}
    conf.update({k: v for k, v in overrides.items() if v is not None})
    if raw.get("settings") or raw.get("axes"):
        raise UsageError(
            f"{where}: fedskew tune tunes one setting: put its options in [experiment] "
            "(no [settings] or [axes])"
        )

    grid = grid_from(raw, source, cli_base, methods, {})  # the evaluation grid, checked
    if grid.base.get("validation_fraction") or any(
        (m or {}).get("validation_fraction") for m in grid.methods.values()
    ):
        raise UsageError(
            f"{where}: validation_fraction is for the trials, which [tune] validation sets; "
            "the evaluation of the tuned methods reports the test set"
        )
    trials = conf.get("trials")
    if not _is_int(trials) or trials < 1:
        raise UsageError(f"[tune] trials (per method) must be a positive integer, got {trials!r}")
    seeds = conf.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds):
        raise UsageError(
            f"[tune] seeds (the tuning seeds) must be a list of integers >= 0, got {seeds!r}"
        )
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"[tune] seeds repeat: {seeds}")
    shared = sorted(set(seeds) & set(grid.seeds))
    if shared:
        raise UsageError(
            f"tuning seeds {seeds} and evaluation seeds {grid.seeds} ([compare] seeds) share "
            f"{shared}: tune on other seeds than those you report"
        )
    last = conf.get("last", grid.options.last)
    if not _is_int(last) or last < 1:
        raise UsageError(f"[tune] last must be a positive integer, got {last!r}")
    pruner = conf.get("pruner", "median")
    if pruner not in PRUNERS:
        raise UsageError(f"[tune] pruner must be one of {', '.join(PRUNERS)}, got {pruner!r}")
    warmup = conf.get("pruner_warmup", DEFAULT_WARMUP)
    if not _is_int(warmup) or warmup < 0:
        raise UsageError(f"[tune] pruner_warmup (rounds) must be an integer >= 0, got {warmup!r}")
    startup = conf.get("pruner_startup", 5)
    if not _is_int(startup) or startup < 0:
        raise UsageError(f"[tune] pruner_startup (trials) must be an integer >= 0, got {startup!r}")
    validation = conf.get("validation", DEFAULT_VALIDATION)
    if (
        not isinstance(validation, (int, float))
        or isinstance(validation, bool)
        or not 0 < validation < 1
    ):
        raise UsageError(
            f"[tune] validation (the fraction of every client's training data the trials "
            f"score on) must be in (0, 1), got {validation!r}"
        )
    sampler = conf.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise UsageError(f"[tune] sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    sampler_seed = conf.get("sampler_seed", 0)
    if not _is_int(sampler_seed) or sampler_seed < 0:
        raise UsageError(f"[tune] sampler_seed must be an integer >= 0, got {sampler_seed!r}")
    batch = conf.get("batch", 1)
    if not _is_int(batch) or batch < 1:
        raise UsageError(f"[tune] batch (trials drawn from one history) must be an integer >= 1, "
                         f"got {batch!r}")  # fmt: skip
    study = str(conf.get("study") or (Path(source).stem if source else "tune"))
    check_name(study, "study")
    out_dir = Path(conf.get("out_dir") or Path("runs") / f"tune-{study}")
    storage = conf.get("storage") or f"sqlite:///{(out_dir / 'study.db').resolve()}"
    if not isinstance(storage, str) or "://" not in storage:
        raise UsageError(f"[tune] storage must be an SQLAlchemy URL, got {storage!r}")
    if in_memory(storage):
        raise UsageError(
            f"[tune] storage {storage!r} is an in-memory database: the study would be lost when "
            "tune ends; give a file (sqlite:///path/study.db) or a database server's URL"
        )

    search = {name: (raw.get("methods", {}).get(name) or {}).get("search") for name in grid.methods}
    missing = [name for name, s in search.items() if s is None]
    if missing:
        raise UsageError(
            f"{where}: method '{missing[0]}' has no [methods.{missing[0]}.search] table"
        )
    tuning = Grid(**{**grid.__dict__, "seeds": [int(s) for s in seeds],
                     "out_dir": out_dir / "trials"})  # fmt: skip
    runs: dict[str, dict[int, PlannedRun]] = {}
    for r in plan(tuning):
        runs.setdefault(r.method, {})[r.seed] = r
    spaces = {}
    for name, table in search.items():
        spaces[name] = read_space(name, table, where)
        if any(d.key in STEP_KEYS for d in spaces[name]):
            raise UsageError(
                f"{where} [methods.{name}.search]: 'rounds' cannot be tuned: the pruner "
                "compares trials round by round (one step per round of one run length); set "
                "rounds in [experiment]"
            )
        check_space(spaces[name], runs[name][int(seeds[0])], where)
    return Tune(
        study=study, out_dir=out_dir, trials=int(trials), seeds=[int(s) for s in seeds],
        eval_seeds=grid.seeds, last=int(last), pruner=pruner, pruner_warmup=int(warmup),
        pruner_startup=int(startup), validation=float(validation), sampler=sampler,
        sampler_seed=int(sampler_seed), batch=int(batch),
        storage=storage, spaces=spaces, runs=runs, grid=grid,
        raw_compare=dict(raw.get("compare", {})), source=source,
    )  # fmt: skip


def in_memory(url: str) -> bool:
    """An SQLite URL without a file (``sqlite://``, ``sqlite:///:memory:``, ``mode=memory``)."""
    if not url.startswith("sqlite"):
        return False
    rest = url.split("://", 1)[1]
    path = rest[1:] if rest.startswith("/") else rest
    return path in ("", ":memory:") or path.startswith(":memory:") or "mode=memory" in path


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------ the study


def open_storage(url: str) -> optuna.storages.RDBStorage:
    # SQLite serialises writers; several tune processes wait for each other's short
    # transactions rather than failing with "database is locked".
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except Exception as exc:  # sqlalchemy's errors: a bad URL, a database out of reach
        raise FedskewError(f"cannot open the study storage {redacted(url)}: "
                           f"{str(exc).splitlines()[0]}") from None  # fmt: skip


def redacted(url: str) -> str:
    """The storage URL without its password (it goes into files and onto the terminal)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL sqlalchemy reads: show it as given
        return url


def make_pruner(name: str, warmup: int = 0, startup: int = 5) -> optuna.pruners.BasePruner:
    """The pruner. The warm-up that matters is the trial's own (``judged_from``: a trial
    reports no round before it), so at a step the median pruner compares the trial with
    the completed trials that reported that step, all past their own warm-up then. Optuna's
    step warm-up is kept as well (steps are rounds, 1-based; Optuna may prune at step ==
    n_warmup_steps): it is already past when a trial first reports."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup + 1)
    if name == "successive-halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=warmup + 1 if warmup else "auto")
    return optuna.pruners.NopPruner()


def sampler_for(name: str, seed: int, number: int) -> optuna.samplers.BaseSampler:
    """The sampler seeded by (sampler seed, slot): a trial's draw depends on the history
    :func:`draw` gives it and its slot, not on which process asked for it or what that
    process drew before (randomness is addressed, not consumed, as in runs)."""
    state = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    if name == "random":
        return optuna.samplers.RandomSampler(seed=state)
    return optuna.samplers.TPESampler(seed=state)


def load_study(tune: Tune, method: str, storage: optuna.storages.RDBStorage) -> optuna.Study:
    return optuna.create_study(
        storage=storage,
        study_name=tune.study_name(method),
        direction="maximize",
        pruner=make_pruner(tune.pruner, tune.pruner_warmup, tune.pruner_startup),
        load_if_exists=True,
    )


def retried(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
    """Numbers of the stale trials whose parameters another trial took over."""
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


def slot_of(trial: optuna.trial.FrozenTrial) -> int:
    """The budget slot a trial holds: its place in the study as an uninterrupted run would
    number it. A retry holds the slot of the trial it resumes, so a kill moves no later trial
    to another slot (and so to another sampler seed). Studies from before slots were stored
    name it in their folder (``<method>-t<slot>``)."""
    if "slot" in trial.user_attrs:
        return int(trial.user_attrs["slot"])
    tail = str(trial.user_attrs.get("folder", "")).rpartition("-t")[2]
    return int(tail) if tail.isdigit() else trial.number


def held(trials: list[optuna.trial.FrozenTrial]) -> dict[int, optuna.trial.FrozenTrial]:
    """slot -> the trial holding it: every trial but the stale ones a retry took over."""
    again = retried(trials)
    return {slot_of(t): t for t in sorted(trials, key=lambda t: t.number)
            if t.number not in again}  # fmt: skip


def counted(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Trials that use the budget: all but the stale ones taken over by a retry."""
    return len(held(trials))


def trial_lock(tune: Tune, method: str, number: int) -> Path:
    return tune.out_dir / LOCKS / f"{method}-t{number}.lock"


def fail_stale(study: optuna.Study, tune: Tune, method: str) -> list[int]:
    """RUNNING trials that no live process runs (their process was killed): marked FAIL and
    their parameters enqueued with their folder name and slot, so that the retry resumes
    their run folders in their place of the study. Called under the study's ask lock, where
    every running trial's lock exists."""
    stale = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if holder(trial_lock(tune, method, t.number)) is not None:
            continue
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        folder = t.user_attrs.get("folder", f"{method}-t{t.number}")
        study.enqueue_trial(t.params, user_attrs={"folder": folder, "retry_of": t.number,
                                                  "slot": slot_of(t)})  # fmt: skip
        stale.append(slot_of(t))
    return stale


def history(tune: Tune, slot: int, trials: list[optuna.trial.FrozenTrial]) -> list[Any] | None:
    """The trials slot ``slot`` is drawn and judged against: the holders of the slots before
    its batch, in slot order; None while one of them has not finished (another process
    runs it)."""
    first = slot - slot % tune.batch
    earlier = [t for s, t in sorted(held(trials).items()) if s < first]
    if any(t.state not in _FINISHED for t in earlier):
        return None
    return earlier


def next_slot(trials: list[optuna.trial.FrozenTrial]) -> int:
    """The slot of a new trial: after the last one held. Contiguous in a study made with
    slots; a study from before them numbered its folders by Optuna's trial number, which
    counted cut-off trials too, so its slots may have gaps and a new one must not reuse one."""
    slots = held(trials)
    return max(slots) + 1 if slots else 0


def draw(tune: Tune, method: str, slot: int, past: list[optuna.trial.FrozenTrial]) -> dict:
    """The values of slot ``slot``: the sampler, seeded by (sampler seed, slot), on a copy of
    the study that holds only ``past``. Neither a kill (its failed trial), nor another
    process's running trial, nor which process asks changes what it sees."""
    sampler = sampler_for(tune.sampler, tune.sampler_seed, slot)
    copy = optuna.create_study(direction="maximize", sampler=sampler)
    for t in past:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            copy.add_trial(t)
    return suggest(copy.ask(), tune.spaces[method])


class PrunerView:
    """The study as the pruner sees it when it judges a trial: the trials of ``history`` only
    (a trial running at the same time in another process is not there), with the real
    storage, where the successive-halving pruner keeps each trial's rungs."""

    def __init__(self, study: optuna.Study, past: list[optuna.trial.FrozenTrial]) -> None:
        self._storage = study._storage  # noqa: SLF001 - the pruner writes rungs through it
        self.direction = study.direction
        self.directions = study.directions
        self._past = past

    def get_trials(
        self, deepcopy: bool = True, states: tuple[TrialState, ...] | None = None
    ) -> list[optuna.trial.FrozenTrial]:
        return [t for t in self._past if states is None or t.state in states]


def should_prune(study: optuna.Study, trial: optuna.Trial, view: PrunerView) -> bool:
    """Optuna's ``trial.should_prune`` against the view instead of the whole study."""
    frozen = study._storage.get_trial(trial._trial_id)  # noqa: SLF001 - as should_prune reads it
    return bool(study.pruner.prune(view, frozen))  # type: ignore[arg-type]


def wait_lock(path: Path) -> int | None:
    """Block until this process holds ``path``'s lock (held for a moment by others)."""
    import time

    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            return lock(path)
        except Busy:
            time.sleep(0.05)


# ------------------------------------------------------------------ running trials


def trial_folders(tune: Tune, method: str, stem: str) -> dict[int, str]:
    return {seed: f"{stem}-s{seed}" for seed in tune.seeds}


def objective(rows: list[dict[str, Any]], last: int) -> float | None:
    """Mean accuracy (%) of the last ``last`` evaluated rounds, None without one."""
    acc = [100 * float(r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    return float(np.mean(acc[-last:])) if acc else None


def read_rows(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def run_seed(
    cfg_values: dict[str, Any], folder: Path, report: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """One tuning seed of a trial: a finished folder read, an unfinished one resumed from
    its checkpoint (its earlier rounds reported first), a missing one run; the rows of
    metrics.jsonl."""
    cfg = build_config(cfg_values, {})
    unfinished = folder.with_name(folder.name + INCOMPLETE)
    for existing in (folder, unfinished):
        if existing.is_dir():
            saved = saved_config(existing)
            if config_hash(saved) != config_hash(cfg):
                raise FedskewError(
                    f"{existing} holds a run with another configuration "
                    f"({config_differences(saved, cfg)}); move it away"
                )
    if (folder / "summary.json").is_file():
        rows = read_rows(folder)
        for row in rows:
            report(row)
        return rows
    if unfinished.is_dir():
        for row in RunFolder.reopen(unfinished).read_metrics():
            report(row)
        path, _ = run(saved_config(unfinished), on_round=report, resume=unfinished)
    else:
        path, _ = run(cfg, on_round=report)
    return read_rows(path)


def num_classes(folder: Path) -> int | None:
    """The classes of a trial's dataset, from its run's config.json (None if unreadable)."""
    try:
        found = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return int(found["resolved"]["num_classes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trial_mark(trial: optuna.trial.FrozenTrial) -> str:
    """Why a trial's value says little about the method: diverged, or no better than chance."""
    if "diverged_round" in trial.user_attrs:
        return f"diverged at round {trial.user_attrs['diverged_round']}"
    classes = trial.user_attrs.get("num_classes")
    if trial.state == TrialState.COMPLETE and classes and trial.value is not None:
        chance = 100 / int(classes)
        if trial.value <= CHANCE_FACTOR * chance:
            return f"chance level ({chance:.3g} % with {classes} classes)"
    return ""


@dataclass
class TrialOutcome:
    number: int
    state: str  # "complete", "pruned", "failed"
    value: float | None
    params: dict[str, Any]
    detail: str = ""


def judged_from(cfg: ExperimentConfig, warmup: int) -> int:
    """The first round (1-based) a trial reports to the pruner: ``warmup`` rounds after the
    round by which every mechanism its method declares has acted (FedFM launched at 0-based
    round s first matches in round s + 1). Past the run's last round: never judged, as a
    trial whose mechanism never acts is in no phase the others are in."""
    return all_acted_round(cfg) + warmup


def trial_step(tune: Tune, method: str, seed_index: int, rnd: int) -> int:
    """The pruner's step of round ``rnd`` (1-based) of a trial's ``seed_index``-th tuning
    seed: steps run on from one seed to the next, one per round."""
    return seed_index * tune.runs[method][tune.seeds[0]].cfg.rounds + rnd


def step_round(tune: Tune, method: str, step: int) -> tuple[int, int]:
    """(tuning seed, round) of a pruner's step, as ``trial_step`` numbers them."""
    rounds = tune.runs[method][tune.seeds[0]].cfg.rounds
    return tune.seeds[min((step - 1) // rounds, len(tune.seeds) - 1)], (step - 1) % rounds + 1


def run_trial(
    tune: Tune,
    method: str,
    study: optuna.Study,
    trial: optuna.Trial,
    past: list[optuna.trial.FrozenTrial],
    progress: Callable[[str], None] | None = None,
) -> TrialOutcome:
    """Take the trial's values (enqueued: drawn by :func:`draw`), run its folders seed after
    seed (reporting each evaluated round to the pruner, which judges it against ``past``),
    and tell the study the objective. ``progress`` gets a line per round."""
    params = suggest(trial, tune.spaces[method])
    slot = slot_of(trial)
    view = PrunerView(study, past)
    stem = trial.user_attrs["folder"]
    values: list[float] = []
    try:
        for index, (seed, name) in enumerate(trial_folders(tune, method, stem).items()):
            planned = tune.runs[method][seed]
            cfg_values = with_values(planned.values, params, f"trial {trial.number}")
            cfg_values.update(name=name, out_dir=str(tune.trials_dir.resolve()),
                              validation_fraction=tune.validation)  # fmt: skip
            first = judged_from(build_config(cfg_values, {}), tune.pruner_warmup)

            rounds = planned.cfg.rounds

            def report(
                row: dict[str, Any], index: int = index, seed: int = seed, first: int = first,
                rounds: int = rounds,
            ) -> None:  # fmt: skip
                if progress is not None:
                    acc = row.get("accuracy")
                    shown = f", accuracy {100 * float(acc):.2f} %" if acc is not None else ""
                    progress(f"{method} trial {slot} seed {seed}: round {row['round']}/{rounds}"
                             f"{shown}")  # fmt: skip
                if row.get("accuracy") is None or int(row["round"]) < first:
                    return
                step = trial_step(tune, method, index, int(row["round"]))
                trial.report(100 * float(row["accuracy"]), step)
                if should_prune(study, trial, view):
                    raise Pruned(f"pruned at round {row['round']} of seed {seed}")

            rows = run_seed(cfg_values, tune.trials_dir / name, report)
            value = objective(rows, tune.last)
            if value is None or not math.isfinite(value):
                raise FedskewError(f"{name} has no evaluated round with an accuracy")
            values.append(value)
    except Pruned as exc:
        study.tell(trial, state=TrialState.PRUNED)
        return TrialOutcome(slot, "pruned", None, params, str(exc))
    except FedskewError as exc:  # the run's own refusal (diverged, bad values): a used trial
        trial.set_user_attr("error", str(exc))
        if isinstance(exc, Diverged):
            trial.set_user_attr("diverged_round", int(exc.round))
        study.tell(trial, state=TrialState.FAIL)
        return TrialOutcome(slot, "failed", None, params, str(exc))
    value = float(np.mean(values))
    classes = num_classes(tune.trials_dir / name)
    if classes:  # the report marks a trial no better than guessing
        trial.set_user_attr("num_classes", classes)
    study.tell(trial, value)
    return TrialOutcome(slot, "complete", value, params)


def tune_method(
    tune: Tune,
    method: str,
    storage: optuna.storages.RDBStorage,
    print_line: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
    wait: bool = True,
) -> optuna.Study:
    """Trials of one method until its study holds the budget (with other processes' ones).
    Each new trial takes the next free slot and its values are drawn from the slots before
    its batch, which it waits for when another process still runs one; a cut-off trial's
    retry keeps its slot. With ``wait``, returns only once every slot's trial has finished
    (taking over any that another process left cut off), so the results it writes are the
    study's final ones."""
    import time

    study = load_study(tune, method, storage)
    ask_lock = tune.out_dir / LOCKS / f"{method}.ask.lock"
    while True:
        trial, past = None, None
        fd = wait_lock(ask_lock)
        try:
            for slot in fail_stale(study, tune, method):
                print_line(f"{method}: trial {slot} was cut off; a new trial resumes its runs")
            trials = study.get_trials(deepcopy=False)
            if any(t.state == TrialState.WAITING for t in trials):
                trial = study.ask()  # a cut-off trial's retry, in its own slot
                # Its history was finished when it was drawn; a study from before slots
                # (trials run at once in several processes) may have one still running.
                past = history(tune, slot_of(trial), trials) or [
                    t for s, t in held(trials).items()
                    if s < slot_of(trial) and t.state in _FINISHED
                ]
            else:
                slot = next_slot(trials)
                if counted(trials) >= tune.trials:
                    if not wait or all(t.state in _FINISHED for t in trials):
                        return study
                else:
                    past = history(tune, slot, trials)
                    if past is not None:
                        params = draw(tune, method, slot, past)
                        study.enqueue_trial(params, user_attrs={"folder": f"{method}-t{slot}",
                                                                "slot": slot})  # fmt: skip
                        trial = study.ask()
            own = wait_lock(trial_lock(tune, method, trial.number)) if trial else None
        finally:
            unlock(fd)
        if trial is None or past is None:
            time.sleep(POLL)  # another process runs an earlier batch's (or the last) trial
            continue
        try:
            outcome = run_trial(tune, method, study, trial, past, progress)
        finally:
            unlock(own)
        slots = held(study.get_trials(deepcopy=False))
        done = sum(t.state in _FINISHED for t in slots.values())
        shown = ", ".join(f"{k}={_short(v)}" for k, v in outcome.params.items())
        result = f"{outcome.value:.2f}" if outcome.value is not None else outcome.state
        mark = trial_mark(slots[outcome.number]) if outcome.number in slots else ""
        if mark and outcome.value is not None:
            result += f" [{mark}]"
        detail = f" ({outcome.detail})" if outcome.detail else ""
        print_line(f"[{method} {done}/{tune.trials}] trial {outcome.number}: {result}{detail}"
                   f"  {shown}")  # fmt: skip


_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def open_studies(tune: Tune) -> tuple[optuna.storages.RDBStorage, dict[str, optuna.Study]]:
    """The storage and every method's study, created if new. Two processes that start
    together would both create the database's tables (and one fail on the other's rows), so
    they take turns here."""
    tune.out_dir.mkdir(parents=True, exist_ok=True)
    fd = wait_lock(tune.out_dir / LOCKS / "storage.lock")
    try:
        storage = open_storage(tune.storage)
        studies = {m: load_study(tune, m, storage) for m in tune.spaces}
        for method, study in studies.items():
            check_definition(study, tune, method)
        return storage, studies
    finally:
        unlock(fd)


# Run values that say where and how a trial runs, not what it computes: a study continued
# from another folder or with other workers is the same study.
PLACE_KEYS = ("out_dir", "name", "quiet", "track_dir", "workers", "threads")
DEFINITION = "fedskew_definition"


def definition(tune: Tune, method: str) -> dict[str, Any]:
    """What a method's study is made from: its runs' configuration per tuning seed, its
    search space, the objective, sampler, pruner and batch. Not the budget (raising it
    continues the study) nor where the trials run."""
    return {
        "runs": {str(seed): {k: v for k, v in r.values.items() if k not in PLACE_KEYS}
                 for seed, r in tune.runs[method].items()},  # fmt: skip
        "search": [d.as_dict() for d in tune.spaces[method]],
        "last": tune.last, "validation": tune.validation, "sampler": tune.sampler,
        "sampler_seed": tune.sampler_seed, "batch": tune.batch, "pruner": tune.pruner,
        "pruner_warmup": tune.pruner_warmup, "pruner_startup": tune.pruner_startup,
    }  # fmt: skip


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: json.dumps(value, sort_keys=True)}


def check_definition(study: optuna.Study, tune: Tune, method: str) -> None:
    """A study remembers what it was made from (in its user attributes) and is continued
    only under the same; a study from before this record takes the current one."""
    mine = json.loads(json.dumps(definition(tune, method)))  # as stored: JSON types
    stored = study.user_attrs.get(DEFINITION)
    if stored is None:
        study.set_user_attr(DEFINITION, mine)
        return
    if stored == mine:
        return
    old, new = _leaves(stored), _leaves(mine)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    shown = "; ".join(f"{k}: {old.get(k, 'absent')} -> {new.get(k, 'absent')}"
                      for k in changed[:3])  # fmt: skip
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    raise UsageError(
        f"study {study.study_name} was made from another tune file ({shown}{more}): its "
        "trials would not be this file's; give another --study or -o, or restore the file"
    )


def tune_all(
    tune: Tune,
    print_line: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> dict[str, optuna.Study]:
    """Every method's trials; then, once no new trial is left to start, waiting for the
    trials other processes still run (and resuming any of them cut off), so that every
    process ends with the study's final results."""
    storage, _ = open_studies(tune)
    for m in tune.spaces:
        tune_method(tune, m, storage, print_line, progress, wait=False)
    return {m: tune_method(tune, m, storage, print_line, progress) for m in tune.spaces}


def studies_of(tune: Tune) -> dict[str, optuna.Study]:
    """The method studies as they stand (for writing results without running): only
    studies that exist, so a mistyped folder or study name is an error, not an empty
    study."""
    default = tune.out_dir / "study.db"
    if tune.storage == f"sqlite:///{default.resolve()}" and not default.is_file():
        raise UsageError(f"no study in {tune.out_dir} (no study.db): check -o / [tune] out_dir")
    storage = open_storage(tune.storage)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    missing = [m for m in tune.spaces if tune.study_name(m) not in names]
    if missing:
        raise UsageError(f"{redacted(tune.storage)} has no study {tune.study_name(missing[0])} "
                         "(check --study and -o)")  # fmt: skip
    studies = {m: load_study(tune, m, storage) for m in tune.spaces}
    for method, study in studies.items():
        check_definition(study, tune, method)
    return studies
