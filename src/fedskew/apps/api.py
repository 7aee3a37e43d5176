"""The Python API: run an experiment from code, with your own algorithm, model or dataset.

    import fedskew
    result = fedskew.run({"dataset": "digits", "rounds": 5}, algorithm=MyAlgorithm)
    print(result.folder, result.summary["final_accuracy"])

``config`` is an ``fedskew.config.ExperimentConfig``, a mapping of config keys (the
long option names of ``fedskew run``), or the path of a TOML/YAML/JSON config file; keyword
``options`` override it. ``algorithm``, ``model`` and ``dataset`` are names (built-in,
``package.module:Name``, or installed entry points) or the objects themselves: an
``Algorithm`` subclass, a model builder ``(input_shape, num_classes, **options) ->
BodyHeadModel``, a dataset loader returning a ``fedskew.data.sources.Dataset``.

An object that can be imported by name is recorded by its ``module:name`` reference, so
worker processes, Flower and ``fedskew run --resume`` find it again. One that cannot (defined
in ``__main__`` or inside a function) is registered in this process only: the run then uses
the in-process engine, and resuming it needs the same object registered again (call
``fedskew.run(..., resume=folder)`` with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fedskew.algorithms import register_algorithm
from fedskew.apps.engine_choice import run_on_its_engine as run_experiment
from fedskew.config import ExperimentConfig, build_config, normalise_keys, read_config_file
from fedskew.core.errors import UsageError
from fedskew.core.references import reference_of
from fedskew.data.user_datasets import register_dataset
from fedskew.models import register_model
from fedskew.runs.folder import RunFolder, saved_config


class RunResult(NamedTuple):
    folder: Path
    summary: dict[str, Any]


def run(
    config: ExperimentConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    algorithm: str | type | None = None,
    model: str | Callable[..., Any] | None = None,
    dataset: str | Callable[..., Any] | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    resume: str | Path | None = None,
    **options: Any,
) -> RunResult:
    """Run an experiment (or continue the unfinished run folder ``resume``); return the
    finished run folder and its summary. Raises FedskewError subclasses with one-line
    messages for bad input."""
    local: list[str] = []
    named = {
        "algorithm": _name_of("algorithm", algorithm, register_algorithm, local),
        "model": _name_of("model", model, register_model, local),
        "dataset": _name_of("dataset", dataset, register_dataset, local),
    }
    if resume is not None:
        # The experiment comes from the folder; how it executes (workers, device, ...) may
        # change, as on the command line. Anything else given is refused, not dropped.
        given = [k for k, v in named.items() if v is not None]
        if config is not None or given:
            names = ", ".join(["config"] * (config is not None) + given)
            raise UsageError(
                f"fedskew.run(resume=...) takes its configuration from the run folder; "
                f"drop: {names}"
            )
        folder = RunFolder.reopen(Path(resume))
        cfg = saved_config(folder.path, options, "fedskew.run(resume=...)")
        return RunResult(*run_experiment(cfg, on_round=on_round, resume=folder.path))
    base = _config_values(config)
    given = {k: v for k, v in named.items() if v is not None}
    values = normalise_keys({**options, **given}, "fedskew.run")
    cfg = build_config(base, values)
    if local:
        if cfg.engine != "inprocess":
            raise UsageError(
                f"{', '.join(local)} cannot be imported by name, so it cannot run on "
                f"{cfg.engine}: define it in an importable module"
            )
        cfg = dataclasses.replace(cfg, workers=0)  # spawned workers could not find it
    return RunResult(*run_experiment(cfg, on_round=on_round))


def _config_values(config: ExperimentConfig | Mapping[str, Any] | str | Path | None) -> dict:
    if config is None:
        return {}
    if isinstance(config, ExperimentConfig):
        return config.to_dict()
    if isinstance(config, (str, Path)):
        return read_config_file(config)
    if isinstance(config, Mapping):
        return normalise_keys(dict(config), "fedskew.run config")
    raise UsageError(
        f"config must be a mapping, an ExperimentConfig or a file path, got {config!r}"
    )


def _name_of(
    kind: str, obj: Any, register: Callable[[str, Any], None], local: list[str]
) -> str | None:
    """The config name of an algorithm/model/dataset given by name or as an object."""
    if obj is None or isinstance(obj, str):
        return obj
    ref = reference_of(obj)
    if ref is not None:
        return ref
    name = f"local:{getattr(obj, '__qualname__', type(obj).__name__)}"
    register(name, obj)
    local.append(f"{kind} {name}")
    return name
