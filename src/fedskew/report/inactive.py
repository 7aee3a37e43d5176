"""Marks for rows whose method had a mechanism that never acted within the run.

A run records such mechanisms when it starts (config.json, ``resolved.inactive_mechanisms``,
from ``Algorithm.inactive_mechanisms``): FedFM launched after the last round is FedAvg. A
table marks the rows of those runs with a footnote symbol, and the footnote names the
mechanism, the options that kept it off and the rows. Runs written before the record
existed carry no mark.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fedskew.report.runs import RunRecord

SYMBOLS = ("†", "‡", "§", "¶", "‖")
LATEX_SYMBOLS = (r"\dagger", r"\ddagger", r"\S", r"\P", r"\|")


@dataclass(frozen=True)
class Note:
    """One mechanism that never acted in a run."""

    mechanism: str
    options: tuple[tuple[str, Any], ...]
    reason: str

    def text(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.mechanism} never acted ({values}): {self.reason}"


def recorded_notes(rec: RunRecord) -> list[Note]:
    """The run's recorded inactive mechanisms; none for a folder without the record."""
    found = rec.resolved.get("inactive_mechanisms")
    if not isinstance(found, list):
        return []
    notes = []
    for item in found:
        if isinstance(item, dict) and isinstance(item.get("mechanism"), str):
            options = item.get("options") if isinstance(item.get("options"), dict) else {}
            values = tuple((str(k), _hashable(v)) for k, v in options.items())
            notes.append(Note(item["mechanism"], values, str(item.get("reason"))))
    return notes


def _hashable(value: Any) -> Any:
    """A recorded option value as the note keeps it (a note is a dict key)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


@dataclass
class Marks:
    """The footnote symbols of one table: each distinct note gets the next symbol, and
    its footnote names the rows it marks."""

    latex: bool = False
    order: list[Note] = field(default_factory=list)
    rows: dict[Note, list[str]] = field(default_factory=dict)

    def symbol(self, i: int) -> str:
        symbols = LATEX_SYMBOLS if self.latex else SYMBOLS
        return symbols[i % len(symbols)] * (i // len(symbols) + 1)

    def mark(self, notes: Iterable[Note], row: str) -> str:
        """The symbols for ``notes`` (``""`` for none), recording ``row`` under each."""
        out = []
        for note in dict.fromkeys(notes):
            if note not in self.rows:
                self.order.append(note)
                self.rows[note] = []
            if row not in self.rows[note]:
                self.rows[note].append(row)
            out.append(self.symbol(self.order.index(note)))
        return "".join(out)

    def footnotes(self) -> list[tuple[str, str]]:
        """(symbol, text) per note, in the order the marks were given."""
        return [
            (self.symbol(i), f"{', '.join(self.rows[n])}: {n.text()}")
            for i, n in enumerate(self.order)
        ]

    def markdown_lines(self) -> list[str]:
        return [f"{symbol} {text}." for symbol, text in self.footnotes()]
