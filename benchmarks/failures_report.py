"""A grid with a diverged and a failed run, its tables and report, looked at in headless Chromium.

    python benchmarks/failures_report.py [--out /tmp/fedskew-failures] [--lr 30]

A one-seed-pair grid on digits (4 clients, 2 per round, 6 rounds, 1 local epoch): FedAvg at its
default lr; ``hot``, FedAvg at ``--lr`` (30 by default), which blows up in a few rounds on some
seeds (a real divergence: NaN in a client's reply); and ``crash``, a FedAvg whose server raises
an error in round 2 (tests/stopping_algorithm.py: a simulated crash, the failure that is not
divergence). It runs ``fedskew compare`` and ``fedskew report`` as a user would, reads the
states back from the run folders (never typed in), renders comparison.html and report.html
to PNG in headless Chromium (Debian's ``chromium``; benchmarks/report_screenshot.py) and
writes ``results/failures_report.md`` with the machine, the compare output, the states and
the picture of the accuracy table. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from machine import machine_facts
from report_screenshot import screenshot

from fedskew.report.runs import find_runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

GRID = """\
[compare]
out_dir = "{out}"
seeds = [0, 1]
reference = "fedavg"
last = 2
jobs = {jobs}
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 6
local_epochs = 1

[methods.fedavg]

[methods.hot]
algorithm = "fedavg"
lr = {lr}

[methods.crash]
algorithm = "stopping_algorithm:CrashAt"
params = {{ at_round = 2 }}
"""


def fedskew(*args: str) -> subprocess.CompletedProcess[str]:
    paths = [str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", "fedskew", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/fedskew-failures"))
    ap.add_argument("--lr", type=float, default=30.0, help="hot's learning rate")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    grid_dir = args.out / "grid"
    file = args.out / "grid.toml"
    file.write_text(GRID.format(out=grid_dir, jobs=args.jobs, lr=args.lr), encoding="utf-8")

    started = time.perf_counter()
    ran = fedskew("compare", "-c", str(file))
    report = fedskew("report", str(grid_dir))
    seconds = time.perf_counter() - started
    if report.returncode != 0:
        sys.exit(f"fedskew report failed: {report.stderr.strip()}")
    states = [(r.folder.name, r.status.label()) for r in find_runs(grid_dir)]
    diverged = [name for name, label in states if label.startswith("diverged")]
    if not diverged:
        sys.exit(f"no run diverged at lr {args.lr} on this machine: try a larger --lr ({states})")

    args.results.mkdir(parents=True, exist_ok=True)
    shots = {}
    for page in ("comparison", "report"):
        png = args.results / f"failures_{page}.png"
        height = 1100 if page == "comparison" else 2600
        screenshot(grid_dir / f"{page}.html", png, 1280, height)
        shots[page] = png
        print(f"screenshot: {png}")

    facts = machine_facts()
    lines = [
        "# A grid with a diverged and a failed run",
        "",
        f"Written by `python benchmarks/failures_report.py --lr {args.lr:g} --jobs {args.jobs}` "
        f"on {facts.get('cpu')} ({facts.get('cores')} cores), {time.strftime('%Y-%m-%d')}; "
        f"digits (scikit-learn's copy), seeds 0 and 1, 6 rounds; compare and report took "
        f"{seconds:.0f} s. `crash` is a simulated crash (tests/stopping_algorithm.py); "
        f"`hot` is FedAvg at lr {args.lr:g}, whose divergence is real.",
        "",
        f"`fedskew compare` exited with status {ran.returncode}; its output:",
        "",
        "```",
        *[line for line in ran.stdout.strip().splitlines()],
        "```",
        "",
        "Each run's state, read back from its folder (`fedskew.report.run_status`):",
        "",
        "| run folder | state |",
        "|---|---|",
        *[f"| {name} | {label} |" for name, label in states],
        "",
        "comparison.html in headless Chromium (Debian's chromium package):",
        "",
        f"![comparison.html]({shots['comparison'].name})",
        "",
        f"report.html: [{shots['report'].name}]({shots['report'].name}).",
        "",
    ]
    md = args.results / "failures_report.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
