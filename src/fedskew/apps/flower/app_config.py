"""The run config table of the Flower app (``[tool.flwr.app.config]`` in
flower/pyproject.toml), written from the option metadata of ExperimentConfig:
``python -m fedskew.apps.flower.app_config flower/pyproject.toml`` rewrites the table in place
(``--check``: exit 1 when it differs; a test compares the two).

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


def rewritten(text: str) -> str:
    """``text`` (flower/pyproject.toml) with its table replaced by :func:`render`'s."""
    at = text.find("\n" + TABLE + "\n")
    if at < 0:
        raise SystemExit(f"no {TABLE} table in the file")
    return text[: at + 1] + render()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the Flower app's run config table")
    parser.add_argument("pyproject", type=Path, help="flower/pyproject.toml")
    parser.add_argument("--check", action="store_true", help="exit 1 when the table differs")
    args = parser.parse_args(argv)
    text = args.pyproject.read_text(encoding="utf-8")
    new = rewritten(text)
    if args.check:
        if new != text:
            print(
                f"{args.pyproject}: its {TABLE} differs from the option metadata", file=sys.stderr
            )
            return 1
        return 0
    args.pyproject.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
