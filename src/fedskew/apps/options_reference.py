"""docs/options.md, written from the option metadata of ExperimentConfig:
``python -m fedskew.apps.options_reference > docs/options.md`` (a test compares the two)."""

from __future__ import annotations

import dataclasses
import sys

from fedskew.apps.options import default_text, flags, metavar
from fedskew.config import ExperimentConfig

HEADER = """\
# Options

<!-- Written by `python -m fedskew.apps.options_reference > docs/options.md` from the option
metadata in src/fedskew/config.py: edit them there, then run it again. -->

Every option of an experiment, by its config key. The same key sets it in a config file
(`fedskew run -c exp.toml`: `lr = 0.01`, or `lr: 0.01` in YAML; dashes or underscores), in
a `fedskew compare` file's `[experiment]`, `[methods.NAME]` and `[settings.NAME]` tables,
in Flower's run config (`flwr run flower ... --run-config 'lr=0.01'`), and in
`fedskew.run(lr=0.01)`. Command-line options win over the config file; tables
(`params`, `partition_params`, `model_options`) merge key by key. All sources read a
value the same way: `--lr 1e-3`, `lr = "1e-3"` and `--run-config lr=1e-3` are one value,
and a bad one gives the same one-line error wherever it comes from.

Notes:
**partition**: an option of `fedskew partition` too;
**execution**: how and where a run executes, not what it computes (left out of the
configuration hash of a checkpoint);
**resume**: a resumed run (`fedskew run --resume`) may change it;
**measurement**: what a run measures besides its training;
**not in Flower run config**: a Flower deployment does not take it, for the reason given.

| Key | Command line | Default | What it does | Notes |
|---|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _command_line(f: dataclasses.Field) -> str:
    if not f.metadata.get("cli", True):
        return "(config only)"
    action = f.metadata.get("action")
    shown = metavar(f) or f.name.upper()
    spelled = [
        f"`{flag}`" if action in ("true", "false") else f"`{flag} {shown}`" for flag in flags(f)
    ]
    spelled += [
        f"`--{key.replace('_', '-')} {key.upper()}`" for key in f.metadata.get("shortcuts", {})
    ]
    return ", ".join(_cell(s) for s in spelled)


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        value = f.default
    text = "unset" if value is None else f"`{value!r}`"
    explained = default_text(f)
    if "default_text" in f.metadata and explained and explained != str(value):
        text += f" ({explained})"
    return _cell(text)


def _notes(f: dataclasses.Field) -> str:
    meta = f.metadata
    notes = [
        word
        for word, tag in (
            ("partition", meta.get("command") == "experiment"),
            ("execution", meta.get("execution")),
            ("resume", meta.get("resumable")),
            ("measurement", meta.get("measurement")),
        )
        if tag
    ]
    if meta.get("flower") is False:
        notes.append(f"not in Flower run config: {meta['flower_reason']}")
    return _cell("; ".join(notes))


def reference() -> str:
    """The text of docs/options.md."""
    rows = [
        f"| `{f.name}` | {_command_line(f)} | {_default(f)} | {_cell(f.metadata['help'])} "
        f"| {_notes(f)} |"
        for f in dataclasses.fields(ExperimentConfig)
    ]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
