"""The Flower app's pyproject.toml (flower/pyproject.toml), written from code: its header,
its declared dependency (this fedskew, with the flower extra) and its run config table
(``[tool.flwr.app.config]``) from the option metadata of ExperimentConfig.
``python -m fedskew.apps.flower.app_config flower/pyproject.toml`` rewrites the file
(``--check``: exit 1 when it differs; a test compares the two). ``fedskew deploy`` and
``--engine flower-sim`` write the same file into a folder of their own (:func:`write_app`),
so the app they submit is the one ``flwr run flower`` submits, also where fedskew was
installed without its repository.

flwr refuses a ``--run-config`` key the app does not declare, so every option of
``fedskew run`` is declared here, with fedskew's default, except those whose metadata says
``flower=False``; then the keys only the ServerApp reads. The values are TOML: "" for "not
set" (None, an empty table or list), tables as strings of key=value pairs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from fedskew.apps.flower.run_config import SERVER_KEY_NOTES
from fedskew.config import ExperimentConfig
from fedskew.version import __version__

TABLE = "[tool.flwr.app.config]"
# The app's own small federation (a first `flwr run` finishes in minutes), and its run
# folders directly in the output root.
APP_DEFAULTS: dict[str, Any] = {"num_clients": 4, "rounds": 10, "out_dir": None}
# config-file comes first: it is read before the other keys
FIRST = {"config-file": "relative to the output root"}
WIDTH = 100


def toml_value(value: Any) -> str:
    if value is None or value == {} or value == []:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"no TOML form for the default {value!r}")


def _line(key: str, value: str, note: str | None) -> str:
    line = f"{key} = {value}"
    if not note:
        return line
    if len(f"{line}  # {note}") <= WIDTH:
        return f"{line}  # {note}"
    comment = textwrap.wrap(note, WIDTH - 2)
    return "\n".join([*(f"# {c}" for c in comment), line])


def render() -> str:
    """The table, from its header line to the end of the file."""
    lines = [TABLE]
    lines += [_line(k, '""', note) for k, note in FIRST.items()]
    for f in dataclasses.fields(ExperimentConfig):
        if f.metadata.get("flower", True) is False:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        default = APP_DEFAULTS.get(f.name, default)
        key = f.name.replace("_", "-")
        lines.append(_line(key, toml_value(default), f.metadata.get("flower_note")))
    for key, (default, note) in SERVER_KEY_NOTES.items():
        lines.append(_line(key, toml_value(default), note))
    return "\n".join(lines) + "\n"


# Everything above the run config table. The dependency pins this fedskew: the table below
# declares its options, and a node with another version may not understand them.
HEADER = f"""\
# The fedskew Flower app. `flwr run flower <connection> --stream` (or `fedskew deploy
# <connection>`, which also exits non-zero when the run fails) bundles this folder into a
# Flower App Bundle (`flwr build --app flower` writes it) and runs it on the SuperLink and its
# SuperNodes. Its code is its one dependency, fedskew with the flower extra (and the privacy
# extra, whose accountant a DP run's ServerApp needs): the SuperLink
# installs it per run (Flower's runtime dependency installation, on by default; uv must find
# fedskew, see docs/flower.md), a SuperNode has it installed or installs it too
# (flower-supernode --allow-runtime-dependency-installation).
# Written by `python -m fedskew.apps.flower.app_config flower/pyproject.toml`: edit it there.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedskew-flower"
version = "{__version__}"
description = "fedskew's federated algorithms on a Flower federation"
license = "Apache-2.0"
requires-python = ">=3.11"
dependencies = ["fedskew[flower,privacy]=={__version__}"]

[tool.hatch.build.targets.wheel]
bypass-selection = true  # the app's code is its dependency: the bundle holds no module

[tool.flwr.app]
publisher = "fedskew"

[tool.flwr.app.components]
serverapp = "fedskew.apps.flower:server_app"
clientapp = "fedskew.apps.flower:client_app"

# Keys of `fedskew run`, set here or with `flwr run ... --run-config 'k=v'`.
# "" means the fedskew default. Tables are strings of key=value pairs: params = "lam=10".
# Each SuperNode needs `--node-config "partition-id=<i>"` (0 .. num-clients - 1) and may
# add `data-dir="<path>"` for its local copy of the dataset (the server reads its copy from
# $FEDSKEW_DATA or its cache: data-dir is not a run config key of a deployment).
# Paths are relative to the output root that the server operator sets in FEDSKEW_OUTPUT_ROOT
# (the SuperLink's environment); the ServerApp refuses to start without it (see SECURITY.md).
"""


def app_text() -> str:
    """The whole pyproject.toml of the Flower app."""
    return HEADER + render()


def write_app(folder: Path) -> Path:
    """The Flower app in ``folder`` (made if missing): its pyproject.toml, all a bundle
    holds. Returns the folder, for ``flwr run``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(app_text(), encoding="utf-8")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the Flower app's pyproject.toml")
    parser.add_argument("pyproject", type=Path, help="flower/pyproject.toml")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    args = parser.parse_args(argv)
    text = args.pyproject.read_text(encoding="utf-8") if args.pyproject.exists() else ""
    new = app_text()
    if args.check:
        if new != text:
            print(
                f"{args.pyproject}: it differs from the app fedskew writes (its {TABLE} "
                "from the option metadata)",
                file=sys.stderr,
            )
            return 1
        return 0
    args.pyproject.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
