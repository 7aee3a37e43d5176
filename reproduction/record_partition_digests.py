"""Write the digest of each run's partition.npz into its config.json ("resolved" section),
for run folders made before fedskew recorded it there itself.

partition.npz is not committed (it is large), so a report read from a fresh clone can check
that the methods of a (setting, seed) had the same clients only through this digest. The
digest is taken from the folder's own partition.npz, never rebuilt from the configuration;
folders whose partition.npz is gone are listed and left as they are ("not recorded").

    python reproduction/record_partition_digests.py [ROOT ...]   (default: reproduction/runs)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedskew.data.partition import load_partition, partition_digest


def record(folder: Path) -> str:
    """What happened to ``folder``: 'added', 'present', 'agrees', or 'no partition.npz'."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    resolved = config.setdefault("resolved", {})
    npz = folder / "partition.npz"
    if not npz.is_file():
        return "present" if "partition_digest" in resolved else "no partition.npz"
    digest = partition_digest(load_partition(npz)[0])
    if "partition_digest" in resolved:
        if resolved["partition_digest"] != digest:
            raise SystemExit(f"{folder}: config.json's partition digest differs from partition.npz")
        return "agrees"
    resolved["partition_digest"] = digest
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return "added"


def main(roots: list[str]) -> None:
    counts: dict[str, int] = {}
    missing: list[Path] = []
    for root in map(Path, roots or ["reproduction/runs"]):
        for config_path in sorted(root.rglob("config.json")):
            folder = config_path.parent
            if folder.name.endswith(".incomplete"):
                continue  # a run in progress: record it once it has finished
            outcome = record(folder)
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome == "no partition.npz":
                missing.append(folder)
    for outcome, n in sorted(counts.items()):
        print(f"{outcome}: {n}")
    for folder in missing:
        print(f"  not recorded: {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
