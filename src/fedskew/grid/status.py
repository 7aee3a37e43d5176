"""``fedskew compare --status``: where each planned run of a grid stands, read from the grid
folder without changing it."""

from __future__ import annotations

from fedskew.core.errors import FedskewError
from fedskew.core.locks import holder
from fedskew.grid.launch import log_of, slot_of
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.report.checks import check_metrics, check_summary
from fedskew.report.document import one_line
from fedskew.report.files import Damaged, FolderFiles
from fedskew.report.run_status import DIVERGED, read_stop, status_from
from fedskew.report.runs import INCOMPLETE, estimated_seconds, find_runs
from fedskew.runs.folder import running_elsewhere


def status_lines(grid: Grid, runs: list[PlannedRun]) -> list[str]:
    """Where each planned run stands, who is training it, and the CPU time left, judged from
    the grid's finished runs; reads the grid folder and changes nothing."""
    root = grid.out_dir
    # A grid folder may come from elsewhere: its files are read as a report reads them
    # (regular files inside it, checked), and a damaged one is named on its run's line.
    files = FolderFiles(root)
    try:
        records = find_runs(root) if root.is_dir() else []
    except FedskewError:  # a grid folder without any run yet
        records = []
    width = max((len(r.label) for r in runs), default=0)
    kinds = ("finished", DIVERGED, "training", "unfinished", "not run")
    lines, counts = [], dict.fromkeys(kinds, 0)
    left, unknown, failed = 0.0, 0, 0
    for run in runs:
        finished = root / run.folder
        unfinished = finished.with_name(finished.name + INCOMPLETE)
        rounds = run.cfg.rounds
        done = 0
        if files.exists(finished / "summary.json"):
            try:
                summary = check_summary(
                    files.json(finished / "summary.json", "summary"),
                    files.name(finished / "summary.json"),
                )
                acc = summary.get("final_accuracy")
                state = "finished" + ("" if acc is None else f", final accuracy {100 * acc:.2f} %")
            except Damaged as exc:
                state = f"finished, but {exc}"
            counts["finished"] += 1
            lines.append(f"{run.label:<{width}}  {state}")
            continue
        damage, stop = "", None
        if unfinished.is_dir():
            metrics = unfinished / "metrics.jsonl"
            try:
                rows = files.json_lines(metrics, "metrics") if files.exists(metrics) else []
                done = len(check_metrics(rows, files.name(metrics)))
            except Damaged as exc:
                damage = f"; {exc}"
            who = running_elsewhere(unfinished)
            try:
                stop = None if who else read_stop(unfinished, files)
            except Damaged as exc:
                damage += f"; {exc}"
            if stop is not None and stop["state"] == DIVERGED:
                # A result, as a finished run is: compare does not run it again.
                status = status_from(None, stop, None)
                counts[DIVERGED] += 1
                lines.append(f"{run.label:<{width}}  {status.label()}, after {done} of {rounds} "
                             f"rounds{damage}")  # fmt: skip
                continue
            kind = "training" if who else "unfinished"
            state = f"{kind}, {done} of {rounds} rounds" + (f" ({who})" if who else "") + damage
            if stop is not None:  # failed: named from the folder, whatever the log says
                failure = status_from(None, stop, None).label()
                state += f"; last attempt {failure}"
                failed += 1
        else:
            who = holder(slot_of(root, run))
            kind = "training" if who else "not run"
            state = f"starting ({who})" if who else "not run"
        counts[kind] += 1
        log = log_of(root / "logs", run.folder)
        if not who and stop is None and files.exists(log):
            try:
                text = files.read_bytes(log, "log").decode("utf-8", errors="replace")
                tail = one_line(text.strip().splitlines()[-1]) if text.strip() else "no message"
            except Damaged as exc:
                tail = str(exc)
            last = tail
            state += f"; last attempt failed: {last[:117] + '...' if len(last) > 120 else last}"
            failed += 1
        whole = estimated_seconds(records, run.setting, run.method)
        if whole is None:
            unknown += 1
        else:
            left += whole * max(0.0, 1 - done / max(rounds, 1))
        lines.append(f"{run.label:<{width}}  {state}")
    shown = [f"{n} {k}" for k, n in counts.items() if n or k != DIVERGED]
    lines.append(", ".join(shown) + (
        f" ({failed} failed at their last attempt)" if failed else ""
    ))  # fmt: skip
    pending = len(runs) - counts["finished"] - counts[DIVERGED]
    if pending and unknown == pending:
        lines.append("left: unknown (no finished run in these runs' settings to judge from)")
    elif pending:
        known = pending - unknown
        text = (
            f"left: about {left / 3600:.1f} CPU hours for {known} of the {pending} not finished "
            "runs, from the finished runs' recorded time (same setting and method, else same "
            "setting; one run per core as they ran)"
        )
        if unknown:
            text += f"; {unknown} have no finished run in their setting to judge from"
        lines.append(text)
    return lines
