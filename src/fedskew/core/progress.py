"""The progress bar of a run (round, accuracy and ETA) and a live progress line."""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO

from tqdm import tqdm


class RoundProgress:
    """Drawn only once the run starts its rounds, so that an error found while loading
    data or checking parameters is not preceded by an empty bar."""

    def __init__(self, rounds: int, desc: str, disable: bool = False) -> None:
        self.rounds, self.desc, self.disable = rounds, desc, disable
        self.bar: tqdm | None = None

    def start(self, first_round: int) -> None:
        self.bar = tqdm(
            total=self.rounds,
            initial=first_round,
            desc=self.desc,
            unit="round",
            disable=self.disable,
            dynamic_ncols=True,
        )

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            self.start(record["round"] - 1)
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{100 * record['accuracy']:.2f}%", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LiveLine:
    """One line of progress: on a terminal redrawn in place (``\\r``), in a log (not a
    terminal) written as plain lines, so a long trial shows its round and accuracy either
    way. ``print`` writes a lasting line, clearing the live one first."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.shown = 0

    def __call__(self, line: str) -> None:
        if not self.live:
            self.stream.write(line + "\n")
        else:
            width = shutil.get_terminal_size().columns - 1
            text = line[:width]
            self.stream.write("\r" + text + " " * max(0, self.shown - len(text)))
            self.shown = len(text)
        self.stream.flush()

    def clear(self) -> None:
        if self.live and self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0

    def print(self, line: str) -> None:
        self.clear()
        self.stream.write(line + "\n")
        self.stream.flush()
