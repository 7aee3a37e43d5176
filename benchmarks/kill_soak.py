"""Kill soak (issue 15): many SIGKILLs at random points of small runs, then resumes.

For each of a few run configurations, an uninterrupted reference run records its sequence
of file events (tests/kill_child.py: open, each write, fsync, rename of every file a
resume reads, and the final rename). Each scenario then starts the same run and kills it
with SIGKILL at a random event (at a write: after half of its bytes) or at a random time,
kills up to two of its resumes the same way, and resumes until the run is finished. A
scenario passes when the finished run equals the reference in every metrics line, the
summary, the configuration and the final model (timing and processes.jsonl aside), or
when the kill came before config.json was in place and the resume says so in one line,
with no round lost.

    python benchmarks/kill_soak.py --scenarios 300 --minutes 20

writes benchmarks/results/kill_soak.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kill_child import differences, run_child, run_scenario, warm_up  # noqa: E402

from fedskew.core.machine import machine_facts  # noqa: E402

BASE = ["run", "--num-clients=4", "--clients-per-round=2", "--local-epochs=1", "--workers=0",
        "--quiet"]  # fmt: skip
CONFIGS = {
    "fedavg, 3 rounds, checkpoint every round": [*BASE, "--rounds=3", "--seed=1"],
    "scaffold, 4 rounds, checkpoint every 2": [*BASE, "--algorithm=scaffold", "--rounds=4",
                                               "--checkpoint-every=2", "--seed=2"],
    "fedrod, 3 rounds, eval every 2": [*BASE, "--algorithm=fedrod", "--rounds=3",
                                       "--eval-every=2", "--seed=3"],
}  # fmt: skip


def random_kill(rng: random.Random, trace: list[str], seconds: float) -> dict:
    """A random time, or a random kind of file event (uniform over kind:file, so that the
    many write calls of an .npz do not crowd out the rest) at a random occurrence."""
    if rng.random() < 0.2:
        return {"after": round(rng.uniform(0.0, 1.2 * seconds), 3)}
    counts = Counter(trace)
    event = rng.choice(sorted(counts))
    return {"event": event, "occurrence": rng.randint(1, counts[event])}


def judge(outcome: dict, folder: Path, reference: Path) -> tuple[str, str]:
    """(outcome class, detail); classes other than 'equal', 'not started' and 'finished
    before the kill' are failures."""
    steps = outcome["steps"]
    logs = "".join(s["log"] for s in steps)
    if "Traceback" in logs:
        return "FAIL traceback", logs[-500:]
    if any(s["code"] not in (0, -9, 1) for s in steps):
        return "FAIL exit code", str([s["code"] for s in steps])
    if steps[-1]["code"] == 1:
        last = steps[-1]["log"]
        if (
            "no config.json" in last
            and last.count("\n") == 1
            and not (folder / "metrics.jsonl").exists()
            and not (folder / "checkpoint.npz").exists()
        ):
            return "not started (killed before config.json; nothing to lose)", ""
        return "FAIL resume refused", last.strip()
    if outcome["finished"] is None:
        if not folder.exists():
            return "not started (killed before the run folder)", ""
        return "FAIL unfinished", str([s["code"] for s in steps])
    diff = differences(Path(outcome["finished"]), reference)
    if diff:
        return "FAIL differs", ", ".join(diff)
    if steps[0]["code"] == 0:
        return "finished before the kill", ""
    return f"equal after {sum(s['code'] == -9 for s in steps)} kill(s)", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=20.0, help="stop starting new ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kill_soak"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-soak-"))
    started = time.time()
    warm_up(next(iter(CONFIGS.values())), work / "warm-up")
    references = {}
    for label, argv in CONFIGS.items():
        out = work / f"c{len(references)}"
        trace_file = work / f"trace{len(references)}.json"
        t0 = time.time()
        code = run_child([*argv, f"--out-dir={out}", "--name=reference"], None,
                         work / "reference.log", trace_file)  # fmt: skip
        assert code == 0, (work / "reference.log").read_text()
        references[label] = (out, json.loads(trace_file.read_text()), time.time() - t0)
    outcomes: Counter[str] = Counter()
    points: Counter[str] = Counter()
    failures = []
    done = 0
    for number in range(args.scenarios):
        if time.time() - started > 60 * args.minutes:
            break
        label = rng.choice(list(CONFIGS))
        out, trace, seconds = references[label]
        kills = [random_kill(rng, trace, seconds) for _ in range(rng.choice([1, 1, 2, 3]))]
        first = kills[0]
        points["time" if "after" in first else first["event"].split(":")[0]] += 1
        name = f"s{number}"
        outcome = run_scenario(CONFIGS[label], out, name, kills, work / "logs" / name)
        verdict, detail = judge(outcome, out / f"{name}.incomplete", out / "reference")
        outcomes[verdict] += 1
        if verdict.startswith("FAIL"):
            failures.append({"config": label, "kills": kills, "verdict": verdict,
                             "detail": detail, "steps": outcome["steps"]})  # fmt: skip
        for path in (out / name, out / f"{name}.incomplete"):
            shutil.rmtree(path, ignore_errors=True)
        done += 1
    minutes = (time.time() - started) / 60
    facts = machine_facts()
    events = sorted({e for _, trace, _ in references.values() for e in trace})
    lines = [
        "# Kill soak: SIGKILL at random points, then resume",
        "",
        f"Produced by `python benchmarks/kill_soak.py --scenarios {args.scenarios} "
        f"--minutes {args.minutes:g} --seed {args.seed}` ({done} scenarios in {minutes:.1f} min).",
        "",
        f"- Machine: {facts['cpu']}, {facts['cores']} cores, {facts['memory_gib']} GiB; torch "
        f"{facts['torch']}; Python {facts['python']} (shared with other work while it ran).",
        "- Runs: digits, 4 clients, 2 per round, 1 local epoch, in-process; configurations: "
        + "; ".join(CONFIGS) + ".",
        "- Each scenario: the run killed at a random file event (80 %; a kind of event drawn "
        "uniformly, then one of its occurrences: open, a write — after half of its bytes —, "
        "fsync, before and after each rename, of config.json, "
        "partition.npz, checkpoint.npz, metrics.jsonl, processes.jsonl, summary.json and the "
        "final folder rename) or at a random time (20 %); 0 to 2 of its resumes killed the "
        "same way; then resumed until finished. Pass: equal to the uninterrupted run in "
        "every metrics line, summary, config and final model (timing keys and "
        "processes.jsonl aside), or, for a kill before config.json, a one-line refusal with "
        "no round lost.",
        f"- Distinct file events in the reference runs: {len(events)}.",
        "",
        "| outcome | scenarios |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(outcomes.items())],
        "",
        "First kill of each scenario, by kind of event: "
        + ", ".join(f"{k} {v}" for k, v in sorted(points.items())) + ".",
        "",
        f"Failures: {len(failures)}."
        + ("" if not failures else " Details in kill_soak.json."),
        "",
    ]  # fmt: skip
    Path(args.out + ".md").write_text("\n".join(lines))
    Path(args.out + ".json").write_text(json.dumps(
        {"scenarios": done, "minutes": round(minutes, 2), "outcomes": outcomes,
         "first_kill_kinds": points, "failures": failures, "machine": facts}, indent=1
    ))  # fmt: skip
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
