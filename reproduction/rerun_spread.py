"""How far running a committed run again moves its accuracy: the rerun spread that
REPRODUCTION.md's verdicts take as part of their noise margin.

    python reproduction/rerun_spread.py                       # every run in RERUNS
    python reproduction/rerun_spread.py --only fedfm-cifar10/bn/fedavg-s0

Each committed run folder named in RERUNS is run again on this machine, one run at a time
on one torch thread (as the study's runs were), into a temporary folder, with the folder's
own configuration (its config.json, options added since then at the value the run had:
fedskew's ``saved_config``) and so the same seed and data. The rerun's partition digest must
equal the committed run's (or, for folders written before runs recorded it, that of a run of
the same grid, seed and partition settings): otherwise it is not a rerun, and the script
stops. Each rerun's per-round accuracy is then compared

* with the committed run: what another machine, another commit or a modified tree moves
  (the committed processes.jsonl says which of them differ);
* with a second rerun here, for the runs RERUNS asks twice of: what running again on the
  same machine at the same commit moves (zero when training is bitwise reproducible).

The gap between two runs at a window of k rounds is the difference of their mean accuracy
over the last k rounds, in points (the statistic the verdicts average over seeds). The
spread of a kind of difference is the largest gap measured for it, per window.

Writes reproduction/rerun_spread.json (what make_report.py reads; the runs of earlier calls
are kept, each with the machine and commit it ran on) and reproduction/rerun_spread.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedskew.core.machine import machine_facts, software_facts
from fedskew.report.runs import RunRecord, read_run
from fedskew.runs.folder import saved_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / "runs"
JSON_OUT = HERE / "rerun_spread.json"
MD_OUT = HERE / "rerun_spread.md"

# (committed run folder under reproduction/runs, reruns here). Short runs whose committed
# copies came from both machines of the study (Intel Xeon and AMD EPYC, 2 cores each), at
# clean and at modified commits, of the methods the FedFM claims compare. No fedcme-fmnist
# folder recorded its partition digest (nor does a sibling), so none can be checked a rerun.
RERUNS: tuple[tuple[str, int], ...] = (
    ("fedfm-cifar10/bn/fedavg-s0", 2),  # Intel, modified tree: the FedFM claims' reference
    ("fedfm-cifar10/bn/fedfm-s0", 2),  # Intel, modified tree: FedFM, launching at round 4
    ("fedfm-cifar10/bn/fedfm-clip10-s0", 1),  # AMD, clean commit
    ("fedfm-cifar10/bn-niid2/fednova-s0", 1),  # Intel, clean commit, another partition
    ("fedfm-cifar10/bn-missing1/fedavg-s0", 1),  # AMD, modified tree, another partition
)

SAME = "same machine and commit"
COMMIT = "another commit, same CPU model"
MACHINE = "another machine"
# From the narrowest difference to the broadest: a claim whose runs differ by a kind
# admits the spread of that kind and of every narrower one.
KINDS = (SAME, COMMIT, MACHINE)
# What the partition is made from: two runs alike in these have the same clients.
PARTITION_KEYS = (
    "dataset", "data_dir", "num_clients", "partition", "partition_params", "partition_file",
    "partition_overlap", "seed", "synthetic_alpha", "synthetic_beta",
)  # fmt: skip
# Metrics that are a run's result; timings are not.
RESULT_KEYS = ("accuracy", "loss", "train_loss", "client_dist_accuracy")
# The metrics whose spread is measured: those the verdicts judge (global test accuracy, and
# on test sets weighted by each client's label distribution).
METRICS = ("accuracy", "client_dist_accuracy")


class RerunError(SystemExit):
    """A rerun that cannot be compared: one line, non-zero exit."""

    def __init__(self, message: str) -> None:
        super().__init__(f"rerun_spread: {message}")


# --------------------------------------------------------------------------- comparing


def series(record: RunRecord) -> dict[str, list[float]]:
    """Per measured metric, the run's value at each round (metrics the run has)."""
    out = {m: [v for _, v in record.series(m)] for m in METRICS}
    return {m: v for m, v in out.items() if v}


def window_gaps(a: list[float], b: list[float]) -> dict[str, float]:
    """{k: mean of a's last k values - b's, in points} for k = 1 .. n, over the first n
    rounds of both (n: the shorter run's rounds)."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return {
        str(k): round(100 * (sum(a[-k:]) / k - sum(b[-k:]) / k), 4) for k in range(1, n + 1)
    }


def round_gaps(a: list[float], b: list[float]) -> list[float]:
    """Per round, a's accuracy - b's, in points."""
    return [round(100 * (x - y), 4) for x, y in zip(a, b, strict=False)]


def bitwise(a: RunRecord, b: RunRecord) -> bool:
    """Every round's results identical (timings aside)."""
    if len(a.metrics) != len(b.metrics):
        return False
    return all(
        ra.get(k) == rb.get(k) for ra, rb in zip(a.metrics, b.metrics, strict=True)
        for k in RESULT_KEYS
    )  # fmt: skip


def origin(record: RunRecord) -> dict[str, list[str]]:
    """The CPU models, commits (with ' (modified)' for a modified tree), torch versions and
    thread counts that computed the run's rounds, as its processes.jsonl records them."""
    out: dict[str, list[str]] = {"cpu": [], "commit": [], "torch": [], "threads": []}
    for p in record.processes:
        commit = str(p.get("git_commit") or "not recorded")[:10]
        if p.get("git_dirty"):
            commit += " (modified)"
        for key, value in (
            ("cpu", p.get("cpu")), ("commit", commit), ("torch", p.get("torch")),
            ("threads", p.get("torch_threads")),
        ):  # fmt: skip
            text = "not recorded" if value is None else str(value)
            if text not in out[key]:
                out[key].append(text)
    return out


def kind_of(committed: dict[str, list[str]], here: dict[str, list[str]]) -> str:
    """Which kind of difference separates a committed run from a rerun here."""
    if committed["cpu"] != here["cpu"]:
        return MACHINE
    clean = not any(c.endswith("(modified)") for c in committed["commit"] + here["commit"])
    if committed["commit"] != here["commit"] or not clean:
        return COMMIT
    return SAME


def compare_runs(between: str, a: RunRecord, b: RunRecord, one_tree: bool) -> dict[str, Any]:
    """How rerun ``a`` differs from ``b``: the kind of difference, whether bitwise, and the
    gaps per metric (per round and per window). ``one_tree``: both ran from this script's
    checkout as it is, modified or not (two reruns here), so only the machine may differ."""
    sa, sb = series(a), series(b)
    both = [m for m in METRICS if m in sa and m in sb]
    if one_tree:
        kind = SAME if origin(a)["cpu"] == origin(b)["cpu"] else MACHINE
    else:
        kind = kind_of(origin(b), origin(a))
    return {
        "between": between,
        "kind": kind,
        "bitwise": bitwise(a, b),
        "round_gaps": {m: round_gaps(sa[m], sb[m]) for m in both},
        "window_gaps": {m: window_gaps(sa[m], sb[m]) for m in both},
    }


def spread(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of difference: the runs it was measured on and, per metric, the largest
    gap per window, at round 1 and at any round. A window counts only where every run of
    the kind reached it."""
    out: dict[str, dict[str, Any]] = {}
    for name, entry in runs.items():
        for pair in entry["pairs"]:
            kind = out.setdefault(pair["kind"], {"runs": []})
            if name not in kind["runs"]:
                kind["runs"].append(name)
            for metric, gaps in pair["round_gaps"].items():
                m = kind.setdefault(metric, {"window": {}, "round_1": 0.0, "any_round": 0.0})
                m["round_1"] = max(m["round_1"], abs(gaps[0]) if gaps else 0.0)
                m["any_round"] = max(m["any_round"], max(map(abs, gaps), default=0.0))
                for k, gap in pair["window_gaps"][metric].items():
                    m["window"][k] = max(m["window"].get(k, 0.0), abs(gap))
    for kind in out.values():
        shortest = min(runs[n]["rounds"] for n in kind["runs"])
        for metric in METRICS:
            if metric in kind:
                window = kind[metric]["window"]
                kind[metric]["window"] = {k: v for k, v in window.items() if int(k) <= shortest}
    return {k: out[k] for k in KINDS if k in out}


# --------------------------------------------------------------------------- running


def partition_of(config: dict[str, Any]) -> tuple[str, ...]:
    return tuple(json.dumps(config.get(k), sort_keys=True) for k in PARTITION_KEYS)


def committed_digest(folder: Path, record: RunRecord) -> tuple[str | None, str]:
    """The committed run's partition digest and where it came from: its own, else one
    recorded by a run of the same grid with the same partition settings (same clients)."""
    if record.partition_digest:
        return record.partition_digest, "its own"
    grid = RUNS / Path(folder.relative_to(RUNS)).parts[0]
    want = partition_of(record.config)
    for config_path in sorted(grid.rglob("config.json")):
        other = config_path.parent
        if other == folder or other.name.endswith(".incomplete"):
            continue
        saved = json.loads(config_path.read_text(encoding="utf-8"))
        digest = (saved.get("resolved") or {}).get("partition_digest")
        if digest and partition_of(saved) == want:
            return digest, f"{other.relative_to(RUNS)}'s (same seed and partition settings)"
    return None, "not recorded"


def rerun(folder: Path, tmp: Path, name: str, threads: int) -> tuple[RunRecord, float]:
    """Run ``folder``'s configuration again into ``tmp/name``; its record and seconds."""
    values = saved_config(folder).to_dict()
    values.update(out_dir=str(tmp), name=name, quiet=True)
    config_path = tmp / f"{name}.json"
    config_path.write_text(json.dumps(values), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    # The fedskew of this checkout, whatever else is installed.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedskew", "run", "-c", str(config_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate()
    except BaseException:  # interrupted: the run is not left behind, training on
        proc.kill()
        proc.wait()
        raise
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["no message"])[-1]
        raise RerunError(f"rerunning {folder.relative_to(RUNS)} failed: {last}")
    record = read_run(tmp / name)
    if not record.finished:
        raise RerunError(f"the rerun of {folder.relative_to(RUNS)} did not finish")
    return record, seconds


def measure(name: str, times: int, threads: int) -> dict[str, Any]:
    folder = RUNS / name
    if not (folder / "summary.json").is_file():
        raise RerunError(f"{folder.relative_to(ROOT)} is not a finished run folder")
    committed = read_run(folder)
    want, source = committed_digest(folder, committed)
    if want is None:
        raise RerunError(f"{name}: no partition digest to check a rerun against")
    reruns: list[tuple[RunRecord, float]] = []
    with tempfile.TemporaryDirectory(prefix="fedskew-rerun-") as tmp:
        for i in range(times):
            print(f"{name}: rerun {i + 1} of {times} ...", flush=True)
            record, seconds = rerun(folder, Path(tmp), f"rerun{i + 1}", threads)
            if record.partition_digest != want:
                raise RerunError(
                    f"{name}: the rerun's partition ({record.partition_digest}) is not the "
                    f"committed run's ({want}, {source}): not a rerun"
                )
            reruns.append((record, seconds))
    pairs = []
    for i, (record, _) in enumerate(reruns):
        pairs.append(
            compare_runs(f"rerun {i + 1} and the committed run", record, committed, False)
        )
        if i:
            pairs.append(compare_runs(f"rerun {i + 1} and rerun 1", record, reruns[0][0], True))
    return {
        "seed": committed.seed,
        "rounds": len(committed.metrics),
        "partition_digest": want,
        "digest_checked_against": source,
        "committed": {**origin(committed), "series": series(committed)},
        "reruns": [
            {**origin(r), "series": series(r), "seconds": round(s, 1),
             "started": r.processes[0].get("started") if r.processes else None}
            for r, s in reruns
        ],  # fmt: skip
        "pairs": pairs,
    }


# --------------------------------------------------------------------------- writing


def load() -> dict[str, Any]:
    if JSON_OUT.is_file():
        return json.loads(JSON_OUT.read_text(encoding="utf-8"))
    return {"runs": {}}


def pts(x: float, sign: bool = True) -> str:
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = [
        "# Rerun spread of the reproduction study's runs",
        "",
        "Written by `python reproduction/rerun_spread.py` (see its docstring); "
        "REPRODUCTION.md's verdict rule reads `rerun_spread.json`. Each committed run below "
        "was run again with its own configuration, seed and partition (the partition digest "
        "checked), one run at a time on one torch thread. Gaps are in accuracy points "
        "(rerun - committed run, or rerun - first rerun); the window gap is that of the mean "
        "accuracy over the last 3 rounds, the statistic the verdicts use.",
        "",
        "| run (seed) | committed on (CPU; commit) | rerun on (CPU; commit) | compared | "
        "kind | bitwise | round 1 | largest per round (round) | last 3 rounds | seconds |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for name, entry in runs.items():
        c = entry["committed"]
        for pair in entry["pairs"]:
            gaps = pair["round_gaps"]["accuracy"]
            worst = max(range(len(gaps)), key=lambda i: abs(gaps[i])) if gaps else 0
            rerun_i = int(pair["between"].split()[1]) - 1
            r = entry["reruns"][rerun_i]
            lines.append(
                f"| {name} ({entry['seed']}) | {', '.join(c['cpu'])}; {', '.join(c['commit'])} "
                f"| {', '.join(r['cpu'])}; {', '.join(r['commit'])} | {pair['between']} "
                f"| {pair['kind']} | {'yes' if pair['bitwise'] else 'no'} "
                f"| {pts(gaps[0]) if gaps else '-'} "
                f"| {pts(gaps[worst]) if gaps else '-'} ({worst + 1}) "
                f"| {pts(pair['window_gaps']['accuracy'].get('3', float('nan')))} "
                f"| {r['seconds']:.0f} |"
            )
    lines += [
        "",
        "## Spread per kind of difference",
        "",
        "The largest gap (absolute, points) measured for each kind: a claim whose runs came "
        "from one machine and one clean commit is judged against the first; one whose runs "
        "came from several commits or a modified tree on one CPU model against the first "
        "two; one whose runs came from several machines against all three.",
        "",
        "| kind | metric | runs | round 1 | any round | last 1 | last 3 | last 5 |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, s in result["spread"].items():
        for metric in METRICS:
            if metric not in s:
                continue
            m, w = s[metric], s[metric]["window"]
            lines.append(
                f"| {kind} | {metric} | {', '.join(s['runs'])} | {pts(m['round_1'], False)} "
                f"| {pts(m['any_round'], False)} | "
                + " | ".join(pts(w[k], False) if k in w else "-" for k in ("1", "3", "5"))
                + " |"
            )
    lines += [
        "",
        "Machines and commits of the reruns (from their own processes.jsonl); the study's "
        "runs recorded the CPU model, cores and memory, not the host, so 'same machine' "
        "means the same recorded CPU model:",
        "",
    ]
    for name, entry in runs.items():
        for i, r in enumerate(entry["reruns"]):
            lines.append(
                f"- {name} rerun {i + 1}: {', '.join(r['cpu'])}, commit "
                f"{', '.join(r['commit'])}, torch {', '.join(r['torch'])}, "
                f"{', '.join(r['threads'])} thread(s), started {r['started']}, "
                f"{r['seconds']:.0f} s; partition digest {entry['partition_digest'][:12]} "
                f"checked against {entry['digest_checked_against']}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="RUN", help="rerun only these of RERUNS")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the .md from the .json, run nothing"
    )
    args = parser.parse_args()
    if args.threads < 1:
        raise RerunError("--threads must be at least 1")
    # A terminated script ends its running rerun too (see rerun).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    planned = dict(RERUNS)
    unknown = [n for n in args.only or [] if n not in planned]
    if unknown:
        raise RerunError(f"not in RERUNS: {', '.join(unknown)} (known: {', '.join(planned)})")
    result = load()
    if not args.report_only:
        facts = {**machine_facts(), **software_facts()}
        print(f"on {facts['cpu']}, commit {facts.get('git_commit')}", flush=True)
        for name in args.only or planned:
            result["runs"][name] = measure(name, planned[name], args.threads)
            result["spread"] = spread(result["runs"])
            JSON_OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    result["spread"] = spread(result["runs"])
    JSON_OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    MD_OUT.write_text(markdown(result), encoding="utf-8")
    print(f"wrote {JSON_OUT} and {MD_OUT}")


if __name__ == "__main__":
    main()
