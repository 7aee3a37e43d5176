"""Golden check across a code move: run the same tiny experiments with two source trees
and compare their run folders exactly.

Every built-in algorithm, every FedFM variant (tests/test_golden_fedfm.py's list) and the
engines that carry the messages differently (worker processes, clients trained together)
run through the command line in a fresh interpreter, so the check reads
only run folders and does not depend on where modules live. Usage::

    # before the move, from a checkout of the old commit
    python benchmarks/golden_runs.py record --src <old tree>/src before.json
    # after it
    python benchmarks/golden_runs.py record --src src after.json
    python benchmarks/golden_runs.py compare before.json after.json

``compare`` exits 1 and names every run whose metrics, resolved parameters or resolved
facts differ in any bit (timing fields and provenance are left out); it prints which
commits, torch and machine the two files came from. Both files should come from one
machine: another CPU may take other kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = (
    "--num-clients 6 --clients-per-round 3 --rounds 3 --local-epochs 1 --checkpoint-every 0 --quiet"
).split()

BASELINES = (
    "creff fedacd fedavg fedcme feddecorr feddyn fedlc fednh fednova fedntd fedproto fedprox "
    "fedrod fedrs moon scaffold"
).split()

FM = "-p lam=5 -p start_round=1"
PLUG_IN = "--feature-matching " + FM

RESNET_TOGETHER = "--model resnet18 --model-option width=8 --clients-together vmap --workers 0"

# name -> the run's arguments after TINY; workers 0 unless the name says otherwise
RUNS: dict[str, str] = {
    **{a: f"-a {a} --workers 0" for a in BASELINES},
    "fedfm": f"-a fedfm {FM} --workers 0",
    "fedfm-warmup2-prerelu": f"-a fedfm {FM} -p lam_warmup=2 -p match_on=pre_relu --workers 0",
    "fedfm-l2-uniform": f"-a fedfm {FM} -p fm_loss=l2 -p anchor_agg=uniform --workers 0",
    "fedfm-lite": f"-a fedfm-lite {FM} -p a=2 --workers 0",
    "fedprox+fm": f"-a fedprox {PLUG_IN} --workers 0",
    "fedacd+fm": "-a fedacd --feature-matching -p fm_lam=5 -p start_round=1 --workers 0",
    # the other engines and paths
    "fedavg-workers2": "-a fedavg --workers 2",
    "fedcme-workers2": "-a fedcme --workers 2",
    "fedavg-resnet-together": f"-a fedavg {RESNET_TOGETHER}",
    "moon-resnet-together": f"-a moon {RESNET_TOGETHER}",
    "fedavg-shards-augment": "-a fedavg --partition shards --augment --workers 0",
}


def fedskew(src: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "fedskew", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"fedskew {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def folder_facts(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((folder / "config.json").read_text())
    resolved = config.pop("resolved", {})
    return {
        "metrics": [{k: v for k, v in row.items() if "seconds" not in k} for row in rows],
        "config": {k: v for k, v in config.items() if k not in ("out_dir", "name")},
        "resolved": {k: v for k, v in resolved.items() if k not in PROVENANCE},
    }


# versions the run folder records; the source trees compared differ in them by design
PROVENANCE = {"fedskew_version", "torch_version"}


def record(src: Path, out: Path, only: list[str]) -> None:
    names = only or list(RUNS)
    found: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(name, flush=True)
            fedskew(src, ["run", "-o", tmp, "--name", name, *TINY, *RUNS[name].split()])
            found[name] = folder_facts(Path(tmp) / name)
        # what the run folders say produced them (the first run's process record)
        first = (Path(tmp) / names[0] / "processes.jsonl").read_text().splitlines()[0]
    first = json.loads(first)
    keys = ("cpu", "cores", "torch", "python", "git_commit", "git_dirty")
    found["_source"] = {**{k: first.get(k) for k in keys}, "src": str(src.resolve())}
    out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    print(f"before: {a.pop('_source')}\nafter:  {b.pop('_source')}")
    differ = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    for name in differ:
        print(f"DIFFERENT: {name}")
    same = len(a.keys() & b.keys()) - len([n for n in differ if n in a and n in b])
    print(f"{same} of {len(a.keys() | b.keys())} runs identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--src", type=Path, default=Path("src"))
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", nargs="*", default=[])
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.src, args.out, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
