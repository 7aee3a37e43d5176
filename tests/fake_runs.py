"""Run records and run folders made by hand, for report tests that need no training."""

from __future__ import annotations

import json
from pathlib import Path

from fedskew.report.runs import RunRecord

# What a FedFM run of 6 rounds with the default launch round records (config.json).
FM_OFF = {
    "mechanism": "feature matching",
    "options": {"start_round": 20, "rounds": 6},
    "reason": "it first acts in round 21, the run has 6; every round trains and aggregates as "
    "FedAvg",
}


def record(method, seed, accuracies, setting="", inactive=None) -> RunRecord:
    """A finished run whose rounds evaluated ``accuracies`` (in %)."""
    resolved = {} if inactive is None else {"inactive_mechanisms": inactive}
    return RunRecord(
        folder=Path(f"/nowhere/{setting}/{method}-s{seed}"),
        setting=setting,
        method=method,
        seed=seed,
        config={"rounds": len(accuracies), "seed": seed},
        resolved=resolved,
        metrics=[{"round": i + 1, "accuracy": a / 100} for i, a in enumerate(accuracies)],
        summary={},
        processes=[],
    )


def write_run(folder: Path, algorithm: str, accuracies, seed: int = 0, inactive=None) -> Path:
    """A finished run folder (config.json, metrics.jsonl, summary.json) of ``accuracies``."""
    folder.mkdir(parents=True)
    resolved = {} if inactive is None else {"inactive_mechanisms": inactive}
    config = {"algorithm": algorithm, "rounds": len(accuracies), "seed": seed}
    (folder / "config.json").write_text(json.dumps({**config, "resolved": resolved}))
    lines = [{"round": i + 1, "accuracy": a / 100} for i, a in enumerate(accuracies)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "summary.json").write_text(json.dumps({"final_accuracy": lines[-1]["accuracy"]}))
    return folder
