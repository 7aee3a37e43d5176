"""``fedskew compare --status``: where each planned run of a grid stands, read from the grid
folder without changing it."""

from __future__ import annotations

import json

from fedskew.core.durable import read_jsonl
from fedskew.core.errors import FedskewError
from fedskew.core.locks import holder
from fedskew.grid.launch import log_of, slot_of
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.report.runs import INCOMPLETE, estimated_seconds, find_runs
from fedskew.runs.folder import running_elsewhere


def status_lines(grid: Grid, runs: list[PlannedRun]) -> list[str]:
    """Where each planned run stands, who is training it, and the CPU time left, judged from
    the grid's finished runs; reads the grid folder and changes nothing."""
    root = grid.out_dir
    try:
        records = find_runs(root) if root.is_dir() else []
    except FedskewError:  # a grid folder without any run yet
        records = []
    width = max((len(r.label) for r in runs), default=0)
    lines, counts = [], dict.fromkeys(("finished", "training", "unfinished", "not run"), 0)
    left, unknown, failed = 0.0, 0, 0
    for run in runs:
        finished = root / run.folder
        unfinished = finished.with_name(finished.name + INCOMPLETE)
        rounds = run.cfg.rounds
        done = 0
        if (finished / "summary.json").is_file():
            summary = json.loads((finished / "summary.json").read_text(encoding="utf-8"))
            acc = summary.get("final_accuracy")
            state = "finished" + ("" if acc is None else f", final accuracy {100 * acc:.2f} %")
            counts["finished"] += 1
            lines.append(f"{run.label:<{width}}  {state}")
            continue
        if unfinished.is_dir():
            done = sum(1 for row in read_jsonl(unfinished / "metrics.jsonl") if "round" in row)
            who = running_elsewhere(unfinished)
            kind = "training" if who else "unfinished"
            state = f"{kind}, {done} of {rounds} rounds" + (f" ({who})" if who else "")
        else:
            who = holder(slot_of(root, run))
            kind = "training" if who else "not run"
            state = f"starting ({who})" if who else "not run"
        counts[kind] += 1
        log = log_of(root / "logs", run.folder)
        if not who and log.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            last = tail[-1] if tail else "no message"
            state += f"; last attempt failed: {last[:117] + '...' if len(last) > 120 else last}"
            failed += 1
        whole = estimated_seconds(records, run.setting, run.method)
        if whole is None:
            unknown += 1
        else:
            left += whole * max(0.0, 1 - done / max(rounds, 1))
        lines.append(f"{run.label:<{width}}  {state}")
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()) + (
        f" ({failed} failed at their last attempt)" if failed else ""
    ))  # fmt: skip
    pending = len(runs) - counts["finished"]
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
