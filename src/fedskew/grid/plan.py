"""The grid of ``fedskew compare``: a compare file read and its layers (experiment, settings,
axes, methods) merged into settings x methods x seeds, and each planned run's configuration
built and checked before anything runs."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.algorithms import get_algorithm
from fedskew.assembly.prepare import check_names
from fedskew.config import (
    TABLES,
    ExperimentConfig,
    build_config,
    normalise_keys,
)
from fedskew.core.errors import UsageError
from fedskew.core.structured_text import parse_structured_text, read_text_file
from fedskew.grid.executors import EXECUTOR_KEYS
from fedskew.report.latex_style import check_display_names
from fedskew.report.tables import Options

# [tune] and each method's [methods.NAME.search] are fedskew tune's (fedskew.grid.tune);
# compare reads past them, so that one file serves both.
SECTIONS = ("compare", "experiment", "methods", "settings", "axes", "tune")
COMPARE_KEYS = ("out_dir", "seeds", "reference", "last", "target", "jobs", "threads", "track",
                "display_names", *EXECUTOR_KEYS)  # fmt: skip
# What decides a (setting, seed)'s partition and the clients of each round: a setting's,
# never a method's, so that all methods of a setting see the same clients.
SHARED_KEYS = (
    "dataset", "data_dir", "download", "num_clients", "partition", "partition_params",
    "partition_file", "partition_overlap", "seed", "synthetic_alpha", "synthetic_beta",
    "participation", "clients_per_round",
)  # fmt: skip
# The scheme a layer without `partition` inherits when no earlier layer names one.
DEFAULT_PARTITION = ExperimentConfig.partition
# Set by compare for each run.
RUN_KEYS = ("seed", "out_dir", "name", "quiet", "track_dir")


@dataclass
class Grid:
    """What to run: the base experiment, settings, methods and seeds."""

    out_dir: Path
    base: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    settings: dict[str, dict[str, Any]]  # {"": {}} when the grid has one unnamed setting
    seeds: list[int]
    options: Options
    jobs: int = 1
    threads: int | None = None
    source: str = ""  # the compare file, if any
    executor: dict[str, Any] = field(default_factory=dict)  # fedskew.grid.executors checks it
    # The methods' names in the LaTeX tables ([compare] display_names), recorded in
    # compare.json so that `fedskew report` of the grid uses them too.
    display_names: dict[str, str] = field(default_factory=dict)


@dataclass
class PlannedRun:
    setting: str
    method: str
    seed: int
    folder: str  # relative to the grid folder
    values: dict[str, Any]  # config values of `fedskew run`
    cfg: ExperimentConfig = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def label(self) -> str:
        return self.folder


# ------------------------------------------------------------------------ reading a grid


def read_file(path: str | Path) -> dict[str, Any]:
    """The tables of a compare file, or of a plain experiment file (then it is the base)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    if p.suffix.lower() not in {".toml", ".yaml", ".yml", ".json"}:
        raise UsageError(f"config file must end in .toml, .yaml, .yml or .json: {p}")
    text = read_text_file(p, "config file")
    raw = parse_structured_text(text, p.suffix, str(p))
    if raw is None:  # an empty YAML file
        raw = {}
    if not isinstance(raw, dict):
        raise UsageError(f"{p}: the top level must be a table")
    if not any(k in raw for k in SECTIONS):
        return {"experiment": raw}  # a `fedskew run` config file: the base experiment
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise UsageError(
            f"{p}: unknown table '{unknown[0]}' (a compare file has {', '.join(SECTIONS)}; "
            "experiment keys go under [experiment])"
        )
    for key in SECTIONS:
        if key in raw and not isinstance(raw[key], dict):
            raise UsageError(f"{p}: '{key}' must be a table")
    return raw


def typed_values(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Experiment keys checked (names; tables as tables), dotted keys expanded."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if "." in name:
            table, _, leaf = name.partition(".")
            if table not in TABLES:
                raise UsageError(f"{where}: '{key}': only {', '.join(TABLES)} have sub-keys")
            out.setdefault(table, {})[leaf] = value
            continue
        out.update(normalise_keys({name: value}, where))
    return out


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; tables (params, partition_params, model_options) merge by key,
    except that a layer which changes the partition scheme starts its partition_params
    afresh: an earlier layer's parameters were given for another scheme (the base's Dirichlet
    beta means nothing to a setting's ``niid2``)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        scheme = layer.get("partition")
        if scheme is not None and scheme != merged.get("partition", DEFAULT_PARTITION):
            merged.pop("partition_params", None)
        for key, value in layer.items():
            if value is None:
                continue
            if key in TABLES:
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    return merged


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def setting_name(parts: list[tuple[str, Any]]) -> str:
    """``cifar10-beta0.3`` from (("dataset", "cifar10"), ("partition_params.beta", 0.3))."""
    words = []
    for key, value in parts:
        leaf = key.split(".")[-1]
        words.append(value if isinstance(value, str) else f"{leaf}{_short(value)}")
    return re.sub(r"[^A-Za-z0-9._+-]", "-", "-".join(str(w) for w in words))


def grid_from(
    raw: dict[str, Any],
    source: str,
    cli_base: dict[str, Any],
    methods: list[str] | None,
    overrides: dict[str, Any],
) -> Grid:
    """The grid of a compare file's tables, with command-line base options and overrides
    of [compare] keys (seeds, reference, ...) applied."""
    where = source or "the command line"
    settings_raw = raw.get("compare", {})
    unknown = [k for k in settings_raw if k.replace("-", "_") not in COMPARE_KEYS]
    if unknown:
        raise UsageError(
            f"{where}: [compare] has no key '{unknown[0]}' (valid: {', '.join(COMPARE_KEYS)})"
        )
    conf = {k.replace("-", "_"): v for k, v in settings_raw.items()}
    conf.update({k: v for k, v in overrides.items() if v is not None})

    base = merge(typed_values(raw.get("experiment", {}), f"{where} [experiment]"), cli_base)
    for key in RUN_KEYS:
        if key in base and key != "seed":
            raise UsageError(f"{where}: '{key}' is set by compare for each run; drop it")
    if "track" in conf and "track" not in cli_base:  # [compare] track, under --track
        base["track"] = conf["track"]
    if "seed" in base and "seeds" not in conf:
        conf["seeds"] = [base["seed"]]
    base.pop("seed", None)

    file_methods = raw.get("methods", {})
    chosen: dict[str, dict[str, Any]] = {}
    if file_methods:
        if "algorithm" in cli_base:
            raise UsageError(f"{where} names the methods; -a/--algorithm cannot replace them")
        names = methods or list(file_methods)
        missing = [m for m in names if m not in file_methods]
        if missing:
            raise UsageError(
                f"{where} has no method '{missing[0]}' (it has: {', '.join(file_methods)})"
            )
        for name in names:
            value = file_methods[name] or {}
            if not isinstance(value, dict):
                raise UsageError(f"{where}: [methods.{name}] must be a table")
            value = {k: v for k, v in value.items() if k != "search"}
            chosen[name] = typed_values(value, f"{where} [methods.{name}]")
    elif methods:
        chosen = {name: {} for name in methods}
    else:
        name = str(base.get("algorithm", ExperimentConfig.algorithm))
        chosen = {name: {}}
    for name, values in chosen.items():
        _check_name(name, "method")
        values.setdefault("algorithm", name)
        bad = [k for k in values if k in SHARED_KEYS or k in RUN_KEYS]
        if bad:
            raise UsageError(
                f"method '{name}' sets '{bad[0]}', which decides the partition or the clients "
                "of each round (or is set by compare): put it in [experiment], a setting or "
                "an axis, so that every method sees the same clients"
            )

    named = {
        name: typed_values(v or {}, f"{where} [settings.{name}]")
        for name, v in raw.get("settings", {}).items()
    }
    for name in named:
        _check_name(name, "setting")
    axes = raw.get("axes", {})
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"{where}: axis '{key}' must be a non-empty list of values")
        typed_values({key: values[0]}, f"{where} [axes]")
    settings: dict[str, dict[str, Any]] = {}
    combos = list(itertools.product(*[[(k, v) for v in vals] for k, vals in axes.items()]))
    for sname, svalues in (named or {"": {}}).items():
        for combo in combos:
            axis_values = typed_values(dict(combo), f"{where} [axes]")
            name = "-".join(p for p in (sname, setting_name(list(combo))) if p)
            if name:  # "" is the one unnamed setting; "..", "/" or a newline: no folder
                _check_name(name, "setting (from [axes])")
            if name in settings:
                raise UsageError(f"{where}: two settings are both named '{name}'")
            settings[name] = merge(svalues, axis_values)
    for name, values in settings.items():
        if any(k in RUN_KEYS for k in values):
            raise UsageError(
                f"setting '{name}' sets seed, out_dir, name, quiet or track_dir: drop it"
            )

    seeds = conf.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds):
        raise UsageError(f"seeds must be a list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"seeds repeat: {seeds}")
    last = conf.get("last", 10)
    if not _is_int(last) or last < 1:
        raise UsageError(f"last must be a positive integer, got {last!r}")
    target = conf.get("target")
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise UsageError(f"target is an accuracy in percent, got {target!r}")
        if not 1 <= target <= 100:
            raise UsageError(f"target is an accuracy in percent (e.g. 80), got {target!r}")
    reference = conf.get("reference", "fedavg")
    if reference is not None and reference not in chosen:
        reference = None  # no paired column when the reference is not among the methods
    jobs = conf.get("jobs", 1)
    threads = conf.get("threads")
    if not _is_int(jobs) or jobs < 1:
        raise UsageError(f"jobs must be a positive integer, got {jobs!r}")
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise UsageError(f"threads must be a positive integer, got {threads!r}")
    names = check_display_names(conf.get("display_names", {}), f"{where} [compare]")
    out = conf.get("out_dir")
    if out is None:
        out = Path("runs") / (Path(source).stem if source else "compare")
    return Grid(
        out_dir=Path(out),
        base=base,
        methods=chosen,
        settings=settings,
        seeds=[int(s) for s in seeds],
        options=Options(
            reference=reference,
            last=int(last),
            target=None if target is None else float(target),
        ),
        jobs=int(jobs),
        threads=None if threads is None else int(threads),
        source=source,
        executor={k: conf[k] for k in EXECUTOR_KEYS if conf.get(k) is not None},
        display_names=names,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: str, what: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
        raise UsageError(
            f"{what} name '{name}' must be letters, digits and . _ + - (it names folders)"
        )


def folder_of(setting: str, method: str, seed: int) -> str:
    """A planned run's folder relative to its grid folder ('' is the one unnamed setting)."""
    name = f"{method}-s{seed}"
    return f"{setting}/{name}" if setting else name


def plan(grid: Grid) -> list[PlannedRun]:
    """Every run of the grid, its configuration built and checked before anything runs."""
    single = list(grid.settings) == [""]
    runs = []
    out = grid.out_dir.resolve()
    for setting, svalues in grid.settings.items():
        for seed in grid.seeds:
            for method, mvalues in grid.methods.items():
                name = f"{method}-s{seed}"
                folder = folder_of(setting, method, seed)
                values = merge(grid.base, svalues, mvalues)
                values.update(
                    seed=seed,
                    out_dir=str(out if single else out / setting),
                    name=name,
                    quiet=True,
                    track_dir=str(out),  # trackers group the runs by grid, setting, method
                )
                values.setdefault("workers", 0)  # one process per run; jobs run them side by side
                where = f"run {folder}"
                try:
                    cfg = build_config(values, {})
                    check_names(cfg)
                    get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching).make_params(
                        cfg.params
                    )
                except UsageError as exc:
                    raise UsageError(f"{where}: {exc}") from None
                runs.append(PlannedRun(setting, method, seed, folder, values, cfg))
    return runs
