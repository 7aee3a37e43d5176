"""The progress bar of a run: round, accuracy and ETA."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class RoundProgress:
    def __init__(self, rounds: int, desc: str, disable: bool = False) -> None:
        self.bar = tqdm(total=rounds, desc=desc, unit="round", disable=disable, dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{100 * record['accuracy']:.2f}%", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
