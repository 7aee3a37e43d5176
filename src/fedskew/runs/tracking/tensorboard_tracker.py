"""TensorBoard: event files under ``<track dir>/tensorboard/<run>``, one step per round.

Scalars are float32 ``simple_value`` summaries, the form every TensorBoard loader reads.
float64 tensor summaries would carry metrics.jsonl's numbers exactly, but TensorBoard's default
loader (the Rust data server of ``tensorboard-data-server``, TensorBoard 2.21) skips them and
shows the run empty; they appear only with ``--load_fast=false``. TensorBoard therefore shows
each number to float32's 7 significant digits; metrics.jsonl keeps it exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from fedskew.runs.tracking.base import RunInfo, Tracker, outside


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    @classmethod
    def saved_problem(cls, saved: dict[str, Any], run: RunInfo, folder: Path) -> str | None:
        if "log_dir" not in saved:
            return None
        why = outside(saved["log_dir"], run, folder)
        return f"names the log folder {why}" if why else None

    def __init__(self, run: RunInfo, saved: dict[str, Any]) -> None:
        super().__init__(run, saved)
        self.log_dir = Path(saved.get("log_dir") or run.root / "tensorboard" / run.name)
        done = int(saved.get("logged_through", 0))
        # On resume, events a killed process wrote after its last note in tracking.json
        # (steps past logged_through) are dropped by TensorBoard's purge at this step.
        self.writer = SummaryWriter(str(self.log_dir), purge_step=done + 1 if done else None)
        self.last_step = done
        if not saved:
            self.writer.add_text("config", _json_block(run.config), 0)
            self.writer.flush()

    def ids(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def log_round(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            # Not new_style/double_precision: see the module's docstring.
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # on disk before the round counts as logged
        self.last_step = step

    def log_finish(self, summary: dict[str, Any], files: list[Path], report: Path | None) -> None:
        # TensorBoard keeps no files: the summary goes in as text; the run folder has the rest.
        self.writer.add_text("summary", _json_block(summary), self.last_step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def _json_block(values: dict[str, Any]) -> str:
    text = json.dumps(values, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())  # Markdown code block
