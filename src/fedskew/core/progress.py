"""The progress bar of a run: round, accuracy and ETA."""

from __future__ import annotations

from typing import Any

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
