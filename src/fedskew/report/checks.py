"""What each file of a run folder must hold for the report to use it: checked once, where
the file is read (``fedskew.report.runs``), so that the tables, plots and documents can
take a record's numbers as numbers.

Only what the report reads is checked, and only its kind: a metrics line needs its round
(an integer); a number the report computes with must be a number (``"0.5"`` is not); a list
the report walks must be a list of what it holds. A value of another kind is damage: the
run is left out and named, rather than shown with a number made up or stopping the report.
Keys the report only prints (the configuration, the machine) may hold anything.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

from fedskew.metrics.client_spread import CLIENT_SERIES
from fedskew.report.files import Damaged


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A rule: what a value must pass, and what it must be, in words (for the error line).
Rule = tuple[Callable[[Any], bool], str]
INTEGER: Rule = (is_int, "an integer")
NUMBER: Rule = (is_number, "a number")
NUMBER_OR_NONE: Rule = (lambda v: v is None or is_number(v), "a number or null")
# None in a list: a value not measured (a class without test samples, a client not evaluated).
NUMBERS: Rule = (
    lambda v: isinstance(v, list) and all(x is None or is_number(x) for x in v),
    "a list of numbers",
)
INTEGERS: Rule = (lambda v: isinstance(v, list) and all(map(is_int, v)), "a list of integers")
OBJECT_OR_NONE: Rule = (lambda v: v is None or isinstance(v, dict), "an object or null")
LIST: Rule = (lambda v: isinstance(v, list), "a list")
TEXT: Rule = (lambda v: isinstance(v, str), "a string")
TEXT_OR_NONE: Rule = (lambda v: v is None or isinstance(v, str), "a string or null")


def _shown(value: Any) -> str:
    """A short repr: a few levels and items of it, however deep or long the value."""
    text = reprlib.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(found: dict[str, Any], rules: dict[str, Rule], where: str) -> None:
    for key, (ok, kind) in rules.items():
        if key in found and not ok(found[key]):
            raise Damaged(f"{where}: {key} is {_shown(found[key])}, not {kind}")


CONFIG = {"seed": INTEGER, "rounds": INTEGER, "params": OBJECT_OR_NONE, "resolved": OBJECT_OR_NONE}
RESOLVED = {
    "partition_class_samples": INTEGERS,
    "partition_class_clients": INTEGERS,
    "class_names": LIST,
    "inactive_mechanisms": LIST,
}
METRICS = {
    "round": INTEGER,
    **dict.fromkeys(("accuracy", "loss", "client_dist_accuracy", "train_loss"), NUMBER_OR_NONE),
    **dict.fromkeys(
        ("bytes_down", "bytes_up", "seconds", "eval_seconds", "samples", "exchanges"), NUMBER
    ),
    "clients": LIST,
    "per_class_accuracy": NUMBERS,
    **dict.fromkeys(CLIENT_SERIES, NUMBERS),
}
SUMMARY = {
    "last_k_per_class_accuracy": NUMBERS,
    "final_per_class_accuracy": NUMBERS,
    "per_class_last_k": INTEGER,
    "client_state_bytes_max": INTEGER,
    "clients_with_state": INTEGER,
    "final_accuracy": NUMBER_OR_NONE,
    **{
        f"final_{name}_{stat}": NUMBER_OR_NONE
        for name in CLIENT_SERIES
        for stat in ("mean", "std", "worst10", "gap")
    },
}
PROCESS = {"from_round": INTEGER}
NAMES: Rule = (
    lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    "an object of names",
)
MANIFEST = {
    "runs": LIST, "last": INTEGER, "target": NUMBER_OR_NONE, "reference": TEXT_OR_NONE,
    "display_names": NAMES,
}  # fmt: skip
MANIFEST_RUN = {"folder": TEXT, "setting": TEXT, "method": TEXT}


def check_config(config: Any, where: str) -> dict[str, Any]:
    """config.json: an object; its "resolved" facts checked too."""
    if not isinstance(config, dict):
        raise Damaged(f"{where} is {_shown(config)}, not a run configuration (an object)")
    _check(config, CONFIG, where)
    _check(config.get("resolved") or {}, RESOLVED, f"{where} resolved")
    return config


def check_metrics(rows: list[Any], where: str) -> list[dict[str, Any]]:
    """metrics.jsonl: an object per line, each with its round; per-class lists of one
    length (a run has one set of classes)."""
    lengths = set()
    for number, row in enumerate(rows, start=1):
        line = f"{where} line {number}"
        if not isinstance(row, dict):
            raise Damaged(f"{line} is {_shown(row)}, not an object")
        if "round" not in row:
            raise Damaged(f"{line} has no round")
        _check(row, METRICS, line)
        if "per_class_accuracy" in row:
            lengths.add(len(row["per_class_accuracy"]))
    if len(lengths) > 1:
        raise Damaged(
            f"{where}: per_class_accuracy has {sorted(lengths)} classes in different lines"
        )
    return rows


def check_summary(summary: Any, where: str) -> dict[str, Any]:
    if not isinstance(summary, dict):
        raise Damaged(f"{where} is {_shown(summary)}, not a run summary (an object)")
    _check(summary, SUMMARY, where)
    return summary


def check_processes(rows: list[Any], where: str) -> list[dict[str, Any]]:
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise Damaged(f"{where} line {number} is {_shown(row)}, not an object")
        _check(row, PROCESS, f"{where} line {number}")
    return rows


def check_manifest(manifest: Any, where: str, expected_format: str) -> dict[str, Any]:
    """compare.json: its format, and each planned run's folder, setting and method."""
    if not isinstance(manifest, dict) or manifest.get("format") != expected_format:
        raise Damaged(f"{where} is not a fedskew compare manifest ({expected_format})")
    _check(manifest, MANIFEST, where)
    if "last" in manifest and manifest["last"] < 1:
        raise Damaged(f"{where}: last is {manifest['last']}, not 1 or more")
    for number, run in enumerate(manifest.get("runs", []), start=1):
        if not isinstance(run, dict):
            raise Damaged(f"{where}: run {number} is {_shown(run)}, not an object")
        for key in MANIFEST_RUN:
            if key not in run:
                raise Damaged(f"{where}: run {number} has no {key}")
        _check(run, MANIFEST_RUN, f"{where}: run {number}")
    return manifest
