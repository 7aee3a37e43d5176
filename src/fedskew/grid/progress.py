"""Where a running grid stands, while it runs: runs done, running (with their rounds) and
left, and the time left judged from the rounds trained so far. On a terminal one line
redrawn in place; in a log (not a terminal) a plain line every ``every`` seconds, so that a
grid whose first runs load data for minutes does not look hung.

The time left is rounds left x seconds per round / runs at once: seconds per round from
the rounds this compare has trained (finished and running runs; a setting's own rate where
it has one, since settings may differ in dataset and model), counted from each run's
metrics.jsonl on disk, which a run writes as each round ends."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fedskew.grid.plan import PlannedRun
from fedskew.report.runs import INCOMPLETE
from fedskew.runs.folder import running_elsewhere

# Shown by name on the line; more running runs are counted only.
NAMED_RUNNING = 3
CLEAR = "\r\033[K"  # carriage return, erase to the end of the line


def rounds_on_disk(root: Path, run: PlannedRun) -> int:
    """Rounds a run has written (finished folder, else unfinished one; 0 where neither)."""
    finished = root / run.folder
    for folder in (finished, finished.with_name(finished.name + INCOMPLETE)):
        try:
            with open(folder / "metrics.jsonl", "rb") as f:
                return sum(1 for line in f if b'"round"' in line)
        except OSError:
            continue
    return 0


def duration(seconds: float) -> str:
    if seconds < 60:
        return "under a minute"
    return "about " + _minutes(seconds)


def _minutes(seconds: float) -> str:
    minutes = int(seconds / 60 + 0.5)  # half up: 2.5 min is "3 min"
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@dataclass
class _Running:
    began: float
    rounds_at_start: int


class GridProgress:
    """Told when each run begins and ends (from the executor's threads); reads the running
    runs' rounds from disk when it draws its line."""

    def __init__(
        self,
        runs: list[PlannedRun],
        root: Path,
        jobs: int,
        print_line: Callable[[str], None] = print,
        live: bool = False,
        every: float = 60.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        watch_locks: bool = False,
    ) -> None:
        """``watch_locks``: runs are not begun by this process (Ray tasks on a cluster) but
        count as running while a live process holds their folder."""
        self.runs, self.root, self.jobs = runs, root, max(1, jobs)
        self.print_line, self.live, self.every, self.clock = print_line, live, every, clock
        self.stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._done: set[str] = set()
        # Per setting: seconds and rounds trained by this compare, for the rate.
        self._trained: dict[str, list[float]] = {}
        self._drawn = False  # a live line is on the screen
        self._last_plain = -float("inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.watch_locks = watch_locks

    # ------------------------------------------------------------------ told by the executor

    def begin(self, run: PlannedRun) -> None:
        with self._lock:
            self._running[run.folder] = _Running(self.clock(), rounds_on_disk(self.root, run))

    def finish(self, run: PlannedRun, seconds: float, trained: bool) -> None:
        """``run`` has ended; ``trained``: it ran rounds here (finished or resumed), so its
        ``seconds`` count for the rate."""
        with self._lock:
            state = self._running.pop(run.folder, None)
            self._done.add(run.folder)
            if trained and state is not None and seconds > 0:
                rounds = run.cfg.rounds - state.rounds_at_start
                if rounds > 0:
                    spent = self._trained.setdefault(run.setting, [0.0, 0])
                    spent[0] += seconds
                    spent[1] += rounds

    # ---------------------------------------------------------------------------- the line

    def _watch(self) -> None:
        """Runs whose folder a live process holds begin; those let go stay (a retried Ray
        task holds it again) until finish."""
        for run in self.runs:
            if run.folder in self._running or run.folder in self._done:
                continue
            unfinished = self.root / (run.folder + INCOMPLETE)
            if unfinished.is_dir() and running_elsewhere(unfinished) is not None:
                self.begin(run)

    def line(self) -> str:
        if self.watch_locks:
            self._watch()
        now = self.clock()
        with self._lock:
            running = dict(self._running)
            done = set(self._done)
            trained = {k: list(v) for k, v in self._trained.items()}
        by_folder = {r.folder: r for r in self.runs}
        named: list[str] = []
        rounds_left: dict[str, int] = {}
        for folder, state in running.items():
            run = by_folder[folder]
            rounds = rounds_on_disk(self.root, run)
            fresh = rounds - state.rounds_at_start
            if fresh > 0:  # the rounds of running runs count for the rate too
                spent = trained.setdefault(run.setting, [0.0, 0])
                spent[0] += now - state.began
                spent[1] += fresh
            if len(named) < NAMED_RUNNING:
                named.append(f"{folder} {rounds}/{run.cfg.rounds}")
            rounds_left[run.setting] = rounds_left.get(run.setting, 0) + max(
                0, run.cfg.rounds - rounds
            )
        left = [r for r in self.runs if r.folder not in done and r.folder not in running]
        for run in left:
            rounds_left[run.setting] = rounds_left.get(run.setting, 0) + max(
                0, run.cfg.rounds - rounds_on_disk(self.root, run)
            )
        shown = ", ".join(named) + (", ..." if len(running) > len(named) else "")
        parts = [f"grid: {len(done)} of {len(self.runs)} done", f"{len(running)} running"]
        if shown:
            parts[-1] += f" ({shown} rounds)"
        parts.append(f"{len(left)} left")
        return "; ".join([", ".join(parts), self._eta(rounds_left, trained, len(running) +
                                                      len(left))])  # fmt: skip

    def _eta(self, rounds_left: dict[str, int], trained: dict[str, list[float]], runs: int) -> str:
        if not runs:
            return "nothing left"
        every_setting = [sum(v[0] for v in trained.values()), sum(v[1] for v in trained.values())]
        if not every_setting[1]:
            return "time left: known after the first round"
        seconds = 0.0
        for setting, rounds in rounds_left.items():
            spent, count = trained.get(setting) or every_setting
            if not count:
                spent, count = every_setting
            seconds += rounds * spent / count
        return f"time left: {duration(seconds / min(self.jobs, runs))}"

    # ----------------------------------------------------------------------------- showing

    def say(self, text: str) -> None:
        """A line of compare's own (a run ended), above the live line."""
        with self._lock:
            if self._drawn:
                self.stream.write(CLEAR)
                self._drawn = False
            self.print_line(text)
        if self.live:
            self.draw()

    def draw(self) -> None:
        text = self.line()
        width = shutil.get_terminal_size((100, 20)).columns - 1
        if len(text) > width:
            text = text[: max(0, width - 3)] + "..."
        with self._lock:
            self.stream.write(CLEAR + text)
            self.stream.flush()
            self._drawn = True

    def tick(self) -> None:
        """Redraw the live line, or print a plain one where ``every`` seconds have passed."""
        if self.live:
            self.draw()
        elif self.every > 0 and self.clock() - self._last_plain >= self.every:
            self._last_plain = self.clock()
            text = self.line()
            with self._lock:
                self.print_line(text)

    def start(self) -> None:
        """The first line now, then a thread that keeps it current."""
        self.tick()
        period = 1.0 if self.live else min(max(self.every, 0.1), 5.0)
        if not self.live and self.every <= 0:
            return

        def loop() -> None:
            while not self._stop.wait(period):
                self.tick()

        self._thread = threading.Thread(target=loop, name="grid-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self.stream.write(CLEAR)
                self.stream.flush()
                self._drawn = False
