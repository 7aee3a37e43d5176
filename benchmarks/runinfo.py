"""What a run folder records about where its numbers came from: the data copy it read and the
torch of every process that computed its rounds (config.json's "resolved" and processes.jsonl).

The benchmark reports print these instead of a typed description of the data, so a run that
read another copy, or ran under another torch, says so.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from fedskew.core.durable import read_jsonl

NOT_RECORDED = "not recorded"


def run_facts(folder: Path) -> dict[str, Any]:
    """The data source and torch versions one run folder records.

    Each is taken from every process in processes.jsonl (a resumed run may have run on
    several machines) where it records them, else from the first process's config.json.
    """
    config = json.loads((folder / "config.json").read_text())
    resolved = config.get("resolved", {})
    processes = read_jsonl(folder / "processes.jsonl")
    sources = [p["data_source"] for p in processes if "data_source" in p]
    if not sources:
        sources = [resolved.get("dataset_source", NOT_RECORDED)]
    torch = [p["torch"] for p in processes if "torch" in p]
    if not torch and "torch_version" in resolved:
        torch = [resolved["torch_version"]]
    return {
        "dataset_source": " / ".join(dict.fromkeys(sources)),
        "test_samples": resolved.get("test_samples"),
        "torch": list(dict.fromkeys(torch)) or [NOT_RECORDED],
        "processes": processes,
        "config": config,
    }


def describe_facts(facts: dict[str, Any]) -> str:
    """One run's data source and torch, in words."""
    return f"{facts['dataset_source']}; torch {', '.join(facts['torch'])}"


def data_summary(facts: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """A sentence on the data sources and torch versions of the named runs, and whether
    they differ between runs (then each run's must be shown beside it)."""
    if not facts:
        return "no finished runs", False
    kinds = Counter(describe_facts(f) for f in facts.values())
    if len(kinds) == 1:
        (only,) = kinds
        return f"every run read {only} (from each run's config.json and processes.jsonl)", False
    parts = "; ".join(f"{n} run(s): {kind}" for kind, n in kinds.most_common())
    return (
        "the runs differ in the data copy they read or their torch (from each run's "
        f"config.json and processes.jsonl; each run's is given with it): {parts}",
        True,
    )
