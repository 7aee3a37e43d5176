"""Submitting the fedskew app to a SuperLink with Flower's command line, and waiting for the
run's end: ``fedskew deploy`` and ``--engine flower-sim`` (through a SuperLink of its own).

``flwr run --stream`` exits 0 whatever became of the run: the ServerApp's error shows only in
the log. So the run is started with ``flwr run --format json`` (which answers its run id),
its log followed with ``flwr log --stream`` (which ends when the run does), and its status
read with ``flwr ls --run-id``: a failed or stopped run raises a one-line FedskewError with
Flower's details (for a fedskew error, fedskew's own line). No Flower import: the command
line is Flower's stable interface to a SuperLink.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedskew.apps.flower.app_config import torch_build, write_app
from fedskew.apps.flower.run_config import NOT_IN_RUN_CONFIG
from fedskew.core.errors import FedskewError, UsageError

COMPLETED = "finished:completed"
TABLE_NAME = "[tool.flwr.app.config]"


@dataclass(frozen=True)
class RunStatus:
    """A Flower run's status as ``flwr ls`` gives it: ``status`` is "pending", "starting",
    "running" or "finished:completed" / ":failed" / ":stopped"; ``details`` says why a run
    failed ("ServerApp failed with exception: ...")."""

    run_id: int
    status: str
    details: str

    @property
    def finished(self) -> bool:
        return self.status.startswith("finished")


def flower_command(name: str) -> str:
    """One of Flower's commands (``flwr``, ``flower-superlink``): the one installed beside this
    Python first (a virtual environment that is not activated), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise UsageError(f"Flower's {name} command is not installed: pip install 'fedskew[flower]'")
    return found


def toml_value(value: Any) -> str:
    """A run config or federation config value as ``flwr`` parses it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def config_pairs(values: Mapping[str, Any]) -> str:
    """``k=v k2="text"``: one --run-config (or --federation-config) argument."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def _json_answer(proc: subprocess.CompletedProcess, what: str) -> dict[str, Any]:
    """The JSON object a ``flwr ... --format json`` printed, or a one-line error with what
    it said instead."""
    text = proc.stdout.strip()
    try:
        answer = json.loads(text[text.index("{") :]) if "{" in text else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        said = (proc.stderr.strip() or text or f"exit status {proc.returncode}").splitlines()
        raise FedskewError(f"{what}: {said[-1] if said else 'no answer'}")
    if answer.get("success") is False:
        said = str(answer.get("error-message") or answer.get("error") or "").splitlines()
        said = [line.strip() for line in said if line.strip()]
        raise FedskewError(f"{what}: {said[-1] if said else 'no reason given'}")
    return answer


def start_run(
    app: Path,
    connection: str,
    run_config: Iterable[str] = (),
    federation_config: str | None = None,
    federation: str | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Submit the app in folder ``app`` to the SuperLink of ``connection`` (a name in
    $FLWR_HOME/config.toml); its run id."""
    args = [flower_command("flwr"), "run", str(app), connection, "--format", "json"]
    for pairs in run_config:
        args += ["--run-config", pairs]
    if federation_config:
        args += ["--federation-config", federation_config]
    if federation:
        args += ["--federation", federation]
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(env))
    answer = _json_answer(proc, f"flwr run could not start the run on {connection}")
    try:
        return int(answer["run-id"])
    except (KeyError, TypeError, ValueError):
        raise FedskewError(f"flwr run on {connection} answered no run id: {answer}") from None


def follow_log(
    run_id: int,
    connection: str,
    out: IO[str] | int | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """``flwr log RUN_ID CONNECTION --stream`` in the background, its output to ``out`` (a
    file, ``subprocess.DEVNULL``, or None: this process's standard output); it ends when the
    run does."""
    return subprocess.Popen(
        [flower_command("flwr"), "log", str(run_id), connection, "--stream"],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=_env(env),
    )


def run_status(run_id: int, connection: str, env: Mapping[str, str] | None = None) -> RunStatus:
    args = [flower_command("flwr"), "ls", "--run-id", str(run_id), connection, "--format", "json"]
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(env))
    answer = _json_answer(proc, f"flwr ls could not read run {run_id} on {connection}")
    runs = answer.get("runs") or []
    if not runs or not isinstance(runs[0], dict):
        raise FedskewError(f"flwr ls knows no run {run_id} on {connection}")
    row = runs[0]
    return RunStatus(run_id, str(row.get("status", "")), str(row.get("status-details", "")))


def check_finished(status: RunStatus) -> None:
    """A one-line FedskewError unless the run completed."""
    if status.status == COMPLETED:
        return
    how = status.status.rsplit(":", 1)[-1] if status.finished else f"is {status.status}"
    details = " ".join(status.details.split()) or "no details"
    # "ServerApp failed with exception: <fedskew's one line>": the line is what matters.
    for prefix in ("ServerApp failed with exception: ", "Simulation failed with exception: "):
        details = details.removeprefix(prefix)
    raise FedskewError(f"Flower run {status.run_id} {how}: {details}")


# How flwr 1.42 cuts a --run-config argument into key=value pairs (flwr.common.config.
# parse_config_args), each then read as a line of TOML.
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def _flat_keys(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in table.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def run_config_keys(run_config: Iterable[str]) -> list[str]:
    """The keys of ``--run-config`` arguments as flwr reads them: ``k=v`` pairs, or one
    TOML file (nested tables as dotted keys). A file or text flwr cannot read either gives
    no keys here: flwr says what is wrong with it."""
    items = [item for item in run_config if item]
    if len(items) == 1 and items[0].endswith(".toml"):
        try:
            return _flat_keys(tomllib.loads(Path(items[0]).expanduser().read_text("utf-8")))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return []
    keys: list[str] = []
    for item in items:
        lines = "\n".join(f"{k} = {v}" for k, v in _PAIR.findall(item))
        try:
            keys += _flat_keys(tomllib.loads(lines))
        except tomllib.TOMLDecodeError:
            keys += [k for k, _ in _PAIR.findall(item)]
    return list(dict.fromkeys(keys))


def check_run_config_keys(app: Path, run_config: Iterable[str]) -> None:
    """A one-line UsageError naming the first run config key the app does not declare
    (flwr's SuperLink refuses it with "Invalid run configuration." and no name), with the
    declared key it most resembles, or why a deployment does not take it."""
    try:
        table = tomllib.loads((app / "pyproject.toml").read_text("utf-8"))
        declared = set(_flat_keys(table["tool"]["flwr"]["app"].get("config", {})))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return  # not an app fedskew can read: flwr run says what is wrong with it
    for key in run_config_keys(run_config):
        if key in declared:
            continue
        why = NOT_IN_RUN_CONFIG.get(key.replace("-", "_"))
        if why:
            raise UsageError(f"run config key '{key}': a Flower deployment does not take it: {why}")
        close = difflib.get_close_matches(key.replace("_", "-"), sorted(declared), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UsageError(
            f"run config key '{key}' is not one the Flower app declares{hint} (the keys of "
            f"fedskew run, with dashes: see the app's pyproject.toml, {TABLE_NAME})"
        )


def deploy(
    connection: str,
    run_config: Iterable[str] = (),
    app: Path | None = None,
    federation: str | None = None,
    out: IO[str] | int | None = None,
    torch: str | None = None,
) -> RunStatus:
    """``fedskew deploy``: submit the fedskew app (``app``, or the one this fedskew writes,
    its torch pinned to ``torch_build(torch)``: by default the build installed here) to the
    SuperLink of ``connection``, stream its log to ``out`` (default: standard output) and
    wait for its end; raise a one-line FedskewError when it did not complete."""
    if app is not None and torch is not None:
        raise UsageError("--torch chooses the torch of the app fedskew writes: not with --app")
    build = torch_build(torch)
    with tempfile.TemporaryDirectory(prefix="fedskew-app-") as scratch:
        folder = app if app is not None else write_app(Path(scratch) / "fedskew-flower", build)
        check_run_config_keys(folder, run_config)
        run_id = start_run(folder, connection, run_config, federation=federation)
    print(f"fedskew: Flower run {run_id} started on {connection}", file=sys.stderr, flush=True)
    try:
        follow_log(run_id, connection, out).wait()
    except KeyboardInterrupt:
        raise FedskewError(
            f"stopped following Flower run {run_id}, which goes on: "
            f"flwr stop {run_id} {connection} ends it"
        ) from None
    status = run_status(run_id, connection)
    check_finished(status)
    return status


def _env(extra: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if extra is None else {**os.environ, **extra}
