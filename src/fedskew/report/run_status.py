"""Where a run stands, read from its folder: finished, diverged, failed, running or unfinished.

A run that stops with an error writes ``stopped.json`` into its ``.incomplete`` folder
(``fedskew.runs.folder.RunFolder.record_stop``)::

    {"state": "diverged", "round": 9, "rounds_done": 8, "reason": "round 9: client 3 ..."}

- **diverged**: NaN or Inf in a client's reply or in the global model (``round`` is where).
  A result of the method and its hyper-parameters on that seed, not a fault; ``fedskew
  compare`` does not run it again.
- **failed**: any other error (a crash, a file system error, a bug). Not a result: compare
  retries it and exits non-zero.
- **running**: no record, and a live process holds the folder's lock.
- **unfinished**: no record and no process: killed, or stopped by Ctrl-C; it resumes.

A finished run (its summary.json) is finished whatever else the folder holds; a resumed run
removes the record when it continues.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.core.locks import holder
from fedskew.report.files import Damaged, FolderFiles

STOPPED = "stopped.json"
DIVERGED = "diverged"
FAILED = "failed"
STOP_STATES = (DIVERGED, FAILED)
# The lock file a training process holds in its run folder (fedskew.runs.folder.LOCK).
RUN_LOCK = "lock"
INCOMPLETE = ".incomplete"
REASON_CHARS = 160  # of a failure's message in a table cell; the whole is in stopped.json

# The tables' policy for their means, said under every table that has such runs and in
# the explanation above them (comparison.md, report.md) and the LaTeX caption.
MEANS_POLICY = (
    "A run that diverged (NaN or Inf in a client's reply or in the global model) is a result "
    "of its method but has no accuracy to average: it is left out of mean ± std and counted "
    "beside it, with the round where it diverged. Runs that failed (stopped by an error "
    "other than divergence) or are unfinished are not results: they are left out and "
    "counted beside the mean too."
)


@dataclass(frozen=True)
class RunStatus:
    kind: str  # "finished", "diverged", "failed", "running", "unfinished"
    round: int | None = None  # where it diverged or failed (1-based); None when not known
    reason: str = ""  # the error that stopped it
    holder: str | None = None  # who trains it now ("pid N on HOST"), for a running run

    def at(self) -> str:
        return "" if self.round is None else f" at round {self.round}"

    def label(self) -> str:
        """One cell: "diverged at round 9", "failed at round 3: <reason>", "running (pid 7
        on host)", "unfinished", "finished"."""
        if self.kind == DIVERGED:
            return f"{DIVERGED}{self.at()}"
        if self.kind == FAILED:
            reason = self.reason
            if len(reason) > REASON_CHARS:
                reason = reason[: REASON_CHARS - 3] + "..."
            return f"{FAILED}{self.at()}" + (f": {reason}" if reason else "")
        if self.kind == "running":
            return f"running ({self.holder})"
        return self.kind


def status_from(
    summary: dict[str, Any] | None, stop: dict[str, Any] | None, live: str | None
) -> RunStatus:
    """The state of a run whose folder holds ``summary`` (summary.json), ``stop``
    (stopped.json) and whose lock ``live`` holds (None: no live process)."""
    if summary is not None:
        return RunStatus("finished")
    if live is not None:  # a resume is training it: an earlier record is about to go
        return RunStatus("running", holder=live)
    if stop is not None:
        return RunStatus(stop["state"], stop.get("round"), str(stop.get("reason") or ""))
    return RunStatus("unfinished")


def check_stop(value: Any, where: str) -> dict[str, Any]:
    """stopped.json as the tables use it; :class:`Damaged` names what is wrong."""
    if not isinstance(value, dict):
        raise Damaged(f"{where} is not a stop record (not a JSON object)")
    if value.get("state") not in STOP_STATES:
        raise Damaged(f"{where}: state is {value.get('state')!r}, not diverged or failed")
    for key in ("round", "rounds_done"):
        got = value.get(key)
        if got is not None and (not isinstance(got, int) or isinstance(got, bool) or got < 0):
            raise Damaged(f"{where}: {key} is {got!r}, not a round number")
    if not isinstance(value.get("reason", ""), str):
        raise Damaged(f"{where}: reason is not a string")
    return value


def read_stop(folder: Path, files: FolderFiles | None = None) -> dict[str, Any] | None:
    """The folder's stopped.json, checked; None where it has none."""
    files = files if files is not None else FolderFiles(folder)
    path = Path(folder) / STOPPED
    if not files.exists(path):
        return None
    return check_stop(files.json(path, "stop record"), files.name(path))


def live_holder(folder: Path, files: FolderFiles | None = None) -> str | None:
    """Who trains the unfinished run in ``folder`` now, or None. Only a regular lock file
    inside the folder is looked at (a FIFO would block, a link could lead anywhere)."""
    folder = Path(folder)
    if not folder.name.endswith(INCOMPLETE):
        return None
    files = files if files is not None else FolderFiles(folder)
    path = folder / RUN_LOCK
    if not files.exists(path):
        return None
    try:
        files.check(path, "lock")
    except Damaged:
        return None
    return holder(path)


def count_line(statuses: list[RunStatus], always: tuple[str, ...] = ("finished",)) -> str:
    """Counts such as "3 finished, 1 diverged, 1 failed": the kinds in ``always`` even at
    0, the others where some run has them."""
    order = ("finished", DIVERGED, FAILED, "running", "unfinished")
    counts = {k: sum(s.kind == k for s in statuses) for k in order}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n or k in always)
