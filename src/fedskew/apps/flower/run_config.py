"""The Flower run config of a fedskew experiment, and where a deployed ServerApp may write:
the output root that the server operator sets in ``$FEDSKEW_OUTPUT_ROOT``."""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import Any

from fedskew.config import (
    NOT_IN_FLOWER_RUN_CONFIG,
    TABLES,
    ExperimentConfig,
    build_config,
    normalise_keys,
    parse_value,
    read_config_file,
)
from fedskew.core.errors import UsageError
from fedskew.runs.folder import RunFolder, saved_config

# How long the ServerApp waits for one SuperNode per client to connect (run config node-wait).
NODE_WAIT_SECONDS = 120.0
# How long the setup may go without any node answering, on an idle machine: the default limit
# is this times the load per core (see server.setup_limit); run config setup-timeout overrides
# it.
SETUP_TIMEOUT_SECONDS = 120.0
# Where a deployed ServerApp may write: set by the server operator, never by the run config.
OUTPUT_ROOT_VARIABLE = "FEDSKEW_OUTPUT_ROOT"
# Set ("1") in the environment of the SuperLink that `--engine flower-sim` starts for itself:
# its runs are simulations (engine flower-sim in the run folder, resumable with fedskew run).
SIMULATION_VARIABLE = "FEDSKEW_SIMULATION"
# Run config keys that only the ServerApp reads (not experiment configuration): their
# defaults, and what the Flower app's run config says of them.
SERVER_KEY_NOTES: dict[str, tuple[str | float, str]] = {
    "resume": (
        "",
        "an unfinished run folder inside the output root (relative to it, or its absolute "
        "path) to continue; its saved config wins",
    ),
    "node-wait": (
        NODE_WAIT_SECONDS,
        "seconds the ServerApp waits for one SuperNode per client to connect",
    ),
    "setup-timeout": (
        0.0,
        "seconds the setup may go without any node answering; 0: "
        f"{SETUP_TIMEOUT_SECONDS:.0f} s times the server's load per core",
    ),
}
SERVER_KEYS = tuple(SERVER_KEY_NOTES)
# The config keys of `fedskew run` that flower/pyproject.toml does not declare, and why
# (flwr refuses a --run-config key the app does not declare: every other key must be there).
# Declared with the options (tag flower: False in fedskew.config).
NOT_IN_RUN_CONFIG = NOT_IN_FLOWER_RUN_CONFIG


def output_root() -> Path:
    """The folder a deployed ServerApp writes under: ``$FEDSKEW_OUTPUT_ROOT`` of the process
    that runs the ServerApp (the SuperLink's environment reaches it), created when missing.
    Without it the ServerApp refuses to start: its working directory is wherever the
    SuperLink was started, and no folder should be written that the operator did not
    choose."""
    value = os.environ.get(OUTPUT_ROOT_VARIABLE, "").strip()
    if not value:
        raise UsageError(
            f"{OUTPUT_ROOT_VARIABLE} is not set: the fedskew ServerApp writes run folders only "
            f"under the folder the server operator names in {OUTPUT_ROOT_VARIABLE} (in the "
            "environment of flower-superlink, or of the process that runs the ServerApp)"
        )
    root = Path(value).expanduser()
    if not root.is_absolute():
        raise UsageError(f"{OUTPUT_ROOT_VARIABLE} must be an absolute path, got {value!r}")
    try:
        # The operator named it: making it is what they asked for (a first run on a fresh
        # machine), and it holds nothing yet that a run config could reach.
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{OUTPUT_ROOT_VARIABLE}={value} is not a folder") from None
    except OSError as exc:
        raise UsageError(
            f"{OUTPUT_ROOT_VARIABLE}={value}: cannot create the output root "
            f"({exc.strerror or exc}); create it, writable by the SuperLink's account"
        ) from None
    return root.resolve()


def path_in_root(root: Path, value: str, key: str, absolute_ok: bool = False) -> Path:
    """A path from the run config, inside ``root``: relative to it (an absolute path only
    when ``absolute_ok``), no ``..``, and still inside it once symbolic links are followed."""
    text = str(value)
    where = f"run config '{key}'"
    if "\0" in text:
        raise UsageError(f"{where}: a path cannot hold a NUL character")
    path = Path(text)
    if path.is_absolute() or text.startswith(("/", "\\")):
        if not absolute_ok:
            raise UsageError(
                f"{where} must be a path relative to the output root {root} "
                f"({OUTPUT_ROOT_VARIABLE}), got {text!r}"
            )
    elif ".." in PurePosixPath(text.replace("\\", "/")).parts:
        raise UsageError(f"{where} must stay inside the output root: no '..', got {text!r}")
    resolved = (root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise UsageError(f"{where}: {text!r} is outside the output root {root}")
    return resolved


def config_from_run_config(run_config: dict[str, Any], root: Path) -> ExperimentConfig:
    """An ExperimentConfig from Flower's run config, for a ServerApp that writes under
    ``root`` (the operator's output root).

    Keys are the config keys of ``fedskew run`` (dashes or underscores); ``config-file``
    names a fedskew TOML/YAML file read first; the tables ``params``, ``partition-params``
    and ``model-options`` are strings of ``key=value`` pairs ("lam=10 start_round=0");
    empty strings mean "not set". Paths are relative to ``root``: ``out-dir`` (default:
    the root itself), ``config-file`` and ``partition-file``; ``data-dir`` is refused (the
    server reads datasets from ``$FEDSKEW_DATA`` or its cache, each node from its node
    config), also when a config file sets these keys.
    """
    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    for raw_key, value in run_config.items():
        key = raw_key.replace("-", "_")
        if value == "":
            continue
        if key == "config_file":
            path = path_in_root(root, str(value), raw_key)
            file_values = normalise_keys(read_config_file(path), "config-file")
        elif key in TABLES:
            values[key] = parse_value(key, str(value), f"run config '{raw_key}'")
        else:
            values[key] = value
    values = normalise_keys(values, "Flower run config")
    merged = {**file_values, **values}
    if merged.get("data_dir") not in (None, ""):
        raise UsageError(
            "data-dir is not taken from the run config of a deployment: the server reads "
            "datasets from $FEDSKEW_DATA or its cache, each SuperNode from its node config "
            "data-dir"
        )
    # What the run config may not set, a file it names may not either: track_dir there
    # would put tracker files outside the output root.
    for key, why in NOT_IN_RUN_CONFIG.items():
        if file_values.get(key) not in (None, "") and key != "data_dir":
            raise UsageError(
                f"config-file sets '{key}', which a Flower deployment does not take: {why}"
            )
    for key in ("data_dir", "out_dir", "partition_file"):
        file_values.pop(key, None)
        values.pop(key, None)
    values["out_dir"] = str(path_in_root(root, str(merged.get("out_dir") or "."), "out-dir"))
    if merged.get("partition_file") not in (None, ""):
        values["partition_file"] = str(
            path_in_root(root, str(merged["partition_file"]), "partition-file")
        )
    cfg = build_config(file_values, values)
    cfg.engine = "flower"
    return cfg


def resumed_config(value: str, root: Path) -> tuple[ExperimentConfig, Path]:
    """The configuration saved in an unfinished run folder inside ``root`` (a path relative
    to it, or an absolute one that lies in it), to continue it on Flower."""
    folder = path_in_root(root, value, "resume", absolute_ok=True)
    if folder == root:
        raise UsageError(f"run config 'resume' must name a run folder inside {root}, not the root")
    run_folder = RunFolder.reopen(folder)
    cfg = saved_config(run_folder.path)
    cfg.engine = "flower"
    return cfg, run_folder.path


def server_options(run_config: dict[str, Any]) -> dict[str, float | None]:
    """``node-wait`` and ``setup-timeout`` from the run config, in seconds (setup-timeout
    0 or absent: the default, which grows with the machine's load)."""
    options: dict[str, float | None] = {"node_wait": NODE_WAIT_SECONDS, "setup_timeout": None}
    for key in ("node-wait", "setup-timeout"):
        value = run_config.get(key, "")
        if value == "":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"run config '{key}' must be a number of seconds, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"run config '{key}' must be a number of seconds >= 0, got {value}")
        options[key.replace("-", "_")] = float(value) if value > 0 else None
    if options["node_wait"] is None:
        options["node_wait"] = 0.0
    return options
