"""Runs the command lines of docs/privacy.md's first block, exactly as written there (seed 0,
digits, in-process, one torch thread), and writes what each printed: the final accuracy, the
epsilon spent at delta 1e-5, the noise multiplier (solved for where a target epsilon is
given) and the clip norm the run ended with, into benchmarks/results/privacy_examples.json
and into the block of docs/privacy.md between the markers below (issue 48: the page's
examples must train models that learn, their accuracy shown). About 5 minutes of one core.

    python benchmarks/privacy_examples.py            # run, then rewrite the block
    python benchmarks/privacy_examples.py --report-only
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "privacy.md"
RESULTS = ROOT / "benchmarks" / "results" / "privacy_examples.json"
BEGIN, END = "<!-- privacy-examples:begin -->", "<!-- privacy-examples:end -->"
# The commands of the doc's first block, as a user types them (`fedskew run ...`).
EXAMPLES = (
    "fedskew run -a fedavg -n 20 -r 30 --secure-aggregation",
    "fedskew run -a fedavg -n 100 --clients-per-round 20 --dp central --dp-clip 0.5 "
    "--dp-noise 1.0",
    "fedskew run -a fedavg -n 100 --clients-per-round 20 --dp central --dp-clip 0.5 "
    "--dp-target-epsilon 8",
    "fedskew run -a fedprox -n 100 --clients-per-round 20 --secure-aggregation --dp central "
    "--dp-clipping adaptive",
    "fedskew run -a fedavg --dp local --dp-clip 0.5 --dp-noise 0.3",
)


def run_example(command: str, out_dir: Path) -> dict[str, Any]:
    """One example through the command line in this process; what its summary says."""
    import torch

    from fedskew.apps.cli import main

    torch.set_num_threads(1)
    argv = shlex.split(command)[1:] + ["--out-dir", str(out_dir), "--quiet", "--seed", "0"]
    started = time.perf_counter()
    code = main(argv)
    if code != 0:
        raise SystemExit(f"{command}: exit {code}")
    (summary_path,) = out_dir.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    return {
        "command": command,
        "seed": 0,
        "final_accuracy": summary["final_accuracy"],
        "dp_epsilon": summary.get("dp_epsilon"),
        "dp_noise": summary.get("dp_noise"),
        "dp_clip": summary.get("dp_clip"),
        "dp_clip_final": summary.get("dp_clip_final"),
        "seconds": round(time.perf_counter() - started, 1),
    }


def render(results: dict[str, Any]) -> str:
    """The doc's block: a table of the examples from the results file."""
    machine = results["machine"]
    lines = [
        BEGIN,
        "",
        f"What these printed (`python benchmarks/privacy_examples.py`, seed 0, digits, "
        f"in-process, one thread; {machine['cpu']}, torch {machine.get('torch', '?')}, "
        f"fedskew commit {results['commit']}):",
        "",
        "| command | final accuracy | epsilon at delta 1e-5 | noise multiplier | clip norm |",
        "|---|---|---|---|---|",
    ]
    for row in results["examples"]:
        eps = row["dp_epsilon"]
        eps_text = "-" if eps is None and row["dp_noise"] is None else f"{eps:.3g}"
        noise = "-" if row["dp_noise"] is None else f"{row['dp_noise']:.3g}"
        clip = "-" if row["dp_clip"] is None else f"{row['dp_clip']:g}"
        if row["dp_clip_final"] is not None:
            clip += f", adapted to {row['dp_clip_final']:.3g}"
        short = row["command"].replace("fedskew run ", "")
        lines.append(
            f"| `{short}` | {100 * row['final_accuracy']:.1f} % | {eps_text} | {noise} | {clip} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def rewrite_doc(results: dict[str, Any]) -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + render(results) + text[end:], encoding="utf-8")


def commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True, check=False)  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, text=True,
                           capture_output=True, check=False).stdout.strip()  # fmt: skip
    return out.stdout.strip() + ("+modified" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        examples = []
        for command in EXAMPLES:
            with tempfile.TemporaryDirectory() as where:
                examples.append(run_example(command, Path(where)))
            print(examples[-1], flush=True)
        import torch

        machine = {**machine_facts(), "torch": torch.__version__, "load1": load1()}
        results = {"machine": machine, "commit": commit(), "examples": examples}
        RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    rewrite_doc(json.loads(RESULTS.read_text(encoding="utf-8")))
    print(f"wrote {RESULTS.relative_to(ROOT)} and the block of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
