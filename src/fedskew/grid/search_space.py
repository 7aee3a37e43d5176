"""The search spaces of ``fedskew tune``: a method's ``[methods.NAME.search]`` table read into
dimensions (one per tuned option), each checked against the method's configuration before
any trial runs, so that a typo or an empty range is one line up front, not a failed trial."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedskew.algorithms import get_algorithm
from fedskew.config import TABLES, build_config
from fedskew.core.errors import UsageError
from fedskew.grid.plan import RUN_KEYS, SHARED_KEYS, PlannedRun, merge, typed_values

# How a dimension is drawn: from a log-uniform or uniform range of floats, a range of integers
# (both ends included), or a list of choices.
KINDS = ("log", "float", "int", "choice")


@dataclass(frozen=True)
class Dimension:
    key: str  # a config key, dotted for a table's entry: "lr", "params.lam"
    kind: str  # one of KINDS
    values: tuple[Any, ...]  # (low, high), or the choices

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.key} in {list(self.values)}"
        low, high = self.values
        return f"{self.key} {self.kind} [{low}, {high}]"

    def as_dict(self) -> dict[str, Any]:
        return {self.key: {self.kind: list(self.values)}}


def flatten(table: dict[str, Any]) -> dict[str, Any]:
    """``{params = {lam = {log = [..]}}}`` (what TOML makes of ``params.lam = {...}``) as
    ``{"params.lam": {log = [..]}}``: the config's tables (params, partition_params, ...)
    hold dimensions, any other key is one."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if str(key).replace("-", "_") in TABLES and isinstance(value, dict):
            out.update({f"{key}.{leaf}": spec for leaf, spec in value.items()})
        else:
            out[key] = value
    return out


def read_space(method: str, search: Any, where: str) -> list[Dimension]:
    """The dimensions of a method's search table, their shapes checked (not yet their
    names: :func:`check_space` does that against the method's configuration)."""
    if not isinstance(search, dict):
        raise UsageError(f"{where}: [methods.{method}.search] must be a table")
    dims = []
    for key, spec in flatten(search).items():
        at = f"{where} [methods.{method}.search] '{key}'"
        if not isinstance(spec, dict) or len(spec) != 1:
            raise UsageError(f"{at}: give one of {', '.join(KINDS)}, e.g. {{ log = [0.001, 0.1] }}")
        kind, values = next(iter(spec.items()))
        if kind not in KINDS:
            raise UsageError(f"{at}: unknown kind '{kind}' (valid: {', '.join(KINDS)})")
        if not isinstance(values, list) or not values:
            raise UsageError(f"{at}: {kind} takes a non-empty list")
        if kind == "choice":
            if len(set(map(repr, values))) != len(values):
                raise UsageError(f"{at}: choices repeat: {values}")
        else:
            _check_range(kind, values, at)
        dims.append(Dimension(key.replace("-", "_"), kind, tuple(values)))
    if not dims:
        raise UsageError(f"{where}: [methods.{method}.search] tunes nothing")
    return dims


def _check_range(kind: str, values: list[Any], at: str) -> None:
    if len(values) != 2:
        raise UsageError(f"{at}: {kind} takes [low, high], got {values}")
    low, high = values
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if not numbers or (kind == "int" and not all(isinstance(v, int) for v in values)):
        what = "integers" if kind == "int" else "numbers"
        raise UsageError(f"{at}: {kind} takes two {what}, got {values}")
    if not all(math.isfinite(v) for v in values):
        raise UsageError(f"{at}: the range must be finite, got {values}")
    if low >= high:
        raise UsageError(f"{at}: low must be below high, got [{low}, {high}]")
    if kind == "log" and low <= 0:
        raise UsageError(f"{at}: a log range needs low > 0, got [{low}, {high}]")


def check_space(dims: list[Dimension], run: PlannedRun, where: str) -> None:
    """Every dimension names an option the method has, and its ends (or each choice) make a
    valid configuration: the experiment's checks and the algorithm's parameters refuse what
    a trial would have failed on."""
    for dim in dims:
        at = f"{where} [methods.{run.method}.search] '{dim.key}'"
        top = dim.key.split(".")[0]
        if top in SHARED_KEYS or top in RUN_KEYS:
            raise UsageError(
                f"{at}: '{top}' decides the partition or the clients of each round (or is "
                "set per run), so it cannot be tuned per method"
            )
        # A float range draws floats: its ends are checked as floats, so an integer option
        # given { float = [1, 3] } is refused here, not in every trial.
        ends = dim.values if dim.kind == "choice" else [float(v) for v in dim.values[:2]]
        if dim.kind == "int":
            ends = dim.values[:2]
        for value in ends:
            try:
                cfg = build_config(with_values(run.values, {dim.key: value}, at), {})
                algorithm = get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching)
                algorithm.make_params(cfg.params)
            except UsageError as exc:
                raise UsageError(f"{at} = {value!r}: {exc}") from None


def with_values(values: dict[str, Any], chosen: dict[str, Any], where: str) -> dict[str, Any]:
    """A run's configuration values with the chosen (dotted) options put in."""
    return merge(values, typed_values(chosen, where))


def suggest(trial: Any, dims: list[Dimension]) -> dict[str, Any]:
    """The values an Optuna trial draws for the dimensions (or its fixed ones, for a trial
    enqueued with its parameters), keyed by the dimensions' keys."""
    chosen: dict[str, Any] = {}
    for dim in dims:
        if dim.kind == "choice":
            chosen[dim.key] = trial.suggest_categorical(dim.key, list(dim.values))
        elif dim.kind == "int":
            chosen[dim.key] = trial.suggest_int(dim.key, *dim.values)
        else:
            chosen[dim.key] = trial.suggest_float(dim.key, *dim.values, log=dim.kind == "log")
    return chosen
