"""The Python half of benchmarks/gpu_check.sh: CPU/CUDA equivalence per algorithm and the
throughput table, written to benchmarks/results/gpu_check.md (and .json) step by step.

Each step is guarded: a step that fails is a red row of the report, never a missing file, and
the report is rewritten after every step, so a run cut short still leaves what it measured.
The script exits 1 when any row is red (a failed CUDA test, an equivalence row that is not
"ok", a step that raised), 2 when the device is not there.

1. Environment: the device, torch, CUDA and cuDNN, the machine, the commit.
2. CUDA tests: the summary of the pytest log that gpu_check.sh passes (--tests-log/--tests-rc).
3. Equivalence: every registered algorithm on the embedded digits with ResNet-18 (width 8:
   convolutions, BatchNorm and global pooling through cuDNN), fp32, TF32 off, trained three
   ways: on the CPU, on the device one client after another, and on the device with a round's
   clients trained together (vmap) where the algorithm's local step allows it. Each device
   curve is compared with the CPU's, accuracy and train_loss, after enough rounds that every
   algorithm learns on the CPU (see LEARNED), within the algorithm's tolerance, measured from
   how far rounding alone moves its curve (SPREAD_FILE, benchmarks/rounding_spread.py): a
   device path that learns nothing fails, and a row whose CPU curve did not learn is red too
   ("uninformative"), since it cannot tell.
4. Throughput: benchmarks/clients_together.py's table on Fashion-MNIST when a copy is found
   (in --data-dir, else in the checkout's data/ when it exists; then where fedskew's loader
   looks: /usr/share/datasets/fashion-mnist, $FEDSKEW_DATA, its cache, ../shared/data), else
   MNIST, else a synthetic stand-in of Fashion-MNIST's shape, labelled as such (its timings
   hold, its accuracy means nothing).

``--device cpu`` is the dry run for a machine without a GPU: the same code with the CPU as the
"device" (the together column then compares the CPU's vmap path with its one-after-another
path), and a small throughput table, written to benchmarks/out/ (not a result).

    python benchmarks/gpu_check.py --device cuda [--flower] [--tests-log LOG --tests-rc RC]
    python benchmarks/gpu_check.py --device cpu            # dry run
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clients_together  # noqa: E402
from machine import machine_facts  # noqa: E402

from fedskew.algorithms import ALGORITHMS  # noqa: E402
from fedskew.assembly.prepare import new_model, prepare  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.device import device_facts, resolve_device  # noqa: E402
from fedskew.core.errors import FedskewError  # noqa: E402
from fedskew.core.machine import git_commit  # noqa: E402
from fedskew.data.sources import Dataset, load_dataset, register_dataset  # noqa: E402
from fedskew.engines.together import model_obstacle, plain_handler  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The equivalence experiment: small enough for seconds per run, long enough that every
# algorithm learns on the CPU (measured: every one above 0.8 after 6 rounds).
ROUNDS = 6
SETTING: dict[str, Any] = {
    "dataset": "digits",
    "model": "resnet18",
    "model_options": {"width": 8},
    "partition": "iid",
    "num_clients": 6,
    "clients_per_round": 3,
    "local_epochs": 1,
    "lr": 0.01,
    "momentum": 0.9,
    "rounds": ROUNDS,
}
# The methods' own rounds, at this size (CReFF keeps its default feature and classifier
# epochs: with fewer its re-trained classifier stays at chance here).
PARAMS: dict[str, dict[str, Any]] = {
    "fedfm": {"lam": 5, "start_round": 1},
    "fedfm-lite": {"lam": 5, "start_round": 1, "a": 2},
}
LEARNED = 0.5  # last-round accuracy both curves must reach (chance: 0.1)
# fp32 rounding differences (another kernel, another summation order) are amplified by
# training, and more for some algorithms than for others: nudging the initial weights in
# their last bits moved FedAvg's last 3 rounds by up to 0.02 and FedFM-Lite's by 0.22
# (benchmarks/results/gpu_check_spread.md). So the tolerances are measured, per algorithm:
# benchmarks/rounding_spread.py runs each CPU curve again from nudged initial weights and
# allows a multiple of the largest gap that rounding alone produced (SPREAD_FILE). A wrong
# loss or gradient still fails: it shows in round 1's train_loss, or the curve does not
# learn (tests/test_gpu_check.py plants a flipped and a zeroed gradient).
SPREAD_FILE = ROOT / "benchmarks" / "results" / "gpu_check_spread.json"


def experiment() -> dict[str, Any]:
    """What the curves are (the tolerances hold for this experiment only)."""
    return {"setting": SETTING, "params": PARAMS}


@dataclass(frozen=True)
class Tolerance:
    """How far a device curve may be from the CPU's, for one algorithm."""

    round1_train_loss: float  # |train_loss gap| / CPU train_loss, round 1
    last3_accuracy: float  # |gap| of the mean accuracy over the last 3 rounds


def load_tolerances(path: Path = SPREAD_FILE) -> dict[str, Tolerance]:
    """The measured tolerances per algorithm; a ValueError when there are none for this
    experiment (say how to measure them)."""
    again = "run python benchmarks/rounding_spread.py"
    if not path.is_file():
        raise ValueError(f"no measured tolerances ({path} is missing): {again}")
    data = json.loads(path.read_text())
    if data.get("experiment") != json.loads(json.dumps(experiment())):
        raise ValueError(f"{path} was measured on another experiment: {again}")
    return {
        row["algorithm"]: Tolerance(row["round1_train_loss_tol"], row["last3_accuracy_tol"])
        for row in data["rows"]
    }


def tolerances() -> str:
    return (
        "round 1's |train_loss gap| (relative to the CPU's) and the last 3 rounds' mean "
        "|accuracy gap| within the algorithm's tolerance (measured: "
        "benchmarks/results/gpu_check_spread.md), and both curves reach accuracy >= "
        f"{LEARNED} at the last round"
    )


# ---------------------------------------------------------------------------- the report


class Report:
    """The report so far, rewritten (Markdown and JSON) after every step."""

    def __init__(self, out: Path, command: str, dry_run: bool) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "dry_run": dry_run,
            "steps": [],
        }

    def step(self, name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step; its exception becomes a red row with the error; write the report."""
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"step": name, "status": "running"}
        self.data["steps"].append(entry)
        self.write()
        try:
            result = body()
            entry.update({"status": "ok", **result})
        except Exception as exc:  # the report's row says what happened; the script goes on
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=6)
            print(f"gpu_check: step {name} failed: {entry['error']}", flush=True)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        self.write()
        return entry

    def red(self) -> list[str]:
        """The red rows: a step that did not end ok, or a row of a step that is not ok."""
        red = []
        for entry in self.data["steps"]:
            if entry["status"] not in ("ok", "skipped"):
                red.append(f"{entry['step']}: {entry['status']}")
            for row in entry.get("rows", []):
                if row.get("verdict", "ok") != "ok":
                    red.append(f"{entry['step']} {row.get('algorithm', '')}: {row['verdict']}")
        return red

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(markdown(self.data, self.red()))
        self.out.with_suffix(".json").write_text(json.dumps(self.data, indent=1, default=str))


# ---------------------------------------------------------------------------- step 1


def environment(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {**device_facts(device), "torch": torch.__version__}
    facts["machine"] = machine_facts()
    git = git_commit(ROOT)
    if git["git_commit"] is None:
        facts["commit"] = "unknown (not a git checkout)"
    else:
        facts["commit"] = str(git["git_commit"])[:7]
        facts["uncommitted_changes"] = bool(git["git_dirty"])
    return {"facts": facts}


# ---------------------------------------------------------------------------- step 2


def cuda_tests(log: str | None, rc: int | None) -> dict[str, Any]:
    if log is None:
        return {"status": "skipped", "summary": "gpu_check.sh runs them and passes their log"}
    lines = [x for x in Path(log).read_text(errors="replace").splitlines() if x.strip()]
    failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
    summary = lines[-1].strip("= ") if lines else "(empty log)"
    status = "ok" if rc == 0 else f"exit code {rc}"
    return {"status": status, "summary": summary, "failed": failed[:40]}


# ---------------------------------------------------------------------------- step 3


def curve(algorithm: str, device: str, together: str, out_dir: str) -> list[dict[str, Any]]:
    cfg = ExperimentConfig(
        algorithm=algorithm, params=PARAMS.get(algorithm, {}), **SETTING, workers=0,
        device=device, clients_together=together, tf32=False, out_dir=out_dir,
        name=f"{algorithm}-{device}-{together}-{time.monotonic_ns()}", quiet=True,
    )  # fmt: skip
    folder, _ = run(cfg)
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def trains_together(algorithm: str) -> bool:
    """Whether the algorithm's round trains its clients together under clients_together."""
    cfg = ExperimentConfig(
        algorithm=algorithm, params=PARAMS.get(algorithm, {}), **SETTING, workers=0, device="cpu"
    )
    prep = prepare(cfg)
    model = new_model(prep)
    client = prep.algorithm.Client(prep.params)
    # Any message kind that trains (train, lite_train, FedCME's train_first and train_rest).
    kinds = [name[len("plain_") :] for name in dir(client) if name.startswith("plain_")]
    split = any(plain_handler(client, kind)[0] is not None for kind in kinds)
    return split and not model_obstacle(model)


def raw_gaps(cpu: list[dict[str, Any]], dev: list[dict[str, Any]]) -> dict[str, float]:
    """How far curve ``dev`` is from curve ``cpu`` (rounds of equal number)."""

    def last3(curve: list[dict[str, Any]]) -> float:
        return sum(r["accuracy"] for r in curve[-3:]) / len(curve[-3:])

    round1 = abs(cpu[0]["train_loss"] - dev[0]["train_loss"]) / max(cpu[0]["train_loss"], 1e-12)
    return {
        "round1_train_loss_gap": round(round1, 5),
        "last3_accuracy_gap": round(abs(last3(cpu) - last3(dev)), 4),
        "max_accuracy_gap": round(
            max(abs(a["accuracy"] - b["accuracy"]) for a, b in zip(cpu, dev, strict=True)), 4
        ),
    }


def gaps(
    cpu: list[dict[str, Any]], dev: list[dict[str, Any]], tol: Tolerance | str
) -> dict[str, Any]:
    """The device curve against the CPU's, and the verdict; ``tol`` is the algorithm's
    tolerance, or why there is none (then the row is red, with its gaps)."""
    if len(cpu) != len(dev):
        return {"verdict": f"FAIL: {len(dev)} rounds on the device, {len(cpu)} on the CPU"}
    out: dict[str, Any] = {
        "accuracy": [round(r["accuracy"], 4) for r in dev],
        "train_loss": [round(r["train_loss"], 4) for r in dev],
        **raw_gaps(cpu, dev),
    }
    round1 = out["round1_train_loss_gap"]
    if cpu[-1]["accuracy"] < LEARNED:
        out["verdict"] = f"uninformative: the CPU curve ends at {cpu[-1]['accuracy']:.3f}"
    elif dev[-1]["accuracy"] < LEARNED:
        out["verdict"] = f"FAIL: the device curve ends at {dev[-1]['accuracy']:.3f}"
    elif isinstance(tol, str):
        out["verdict"] = f"no tolerance: {tol}"
    elif round1 > tol.round1_train_loss:
        out["verdict"] = (
            f"FAIL: round 1's train_loss {round1:.1%} away (tolerance {tol.round1_train_loss:.1%})"
        )
    elif out["last3_accuracy_gap"] > tol.last3_accuracy:
        out["verdict"] = (
            f"FAIL: last 3 rounds' accuracy {out['last3_accuracy_gap']:.3f} away "
            f"(tolerance {tol.last3_accuracy:.3f})"
        )
    else:
        out["verdict"] = "ok"
    return out


def tolerance_of(algorithm: str) -> Tolerance | str:
    """The algorithm's measured tolerance, or why there is none."""
    try:
        measured = load_tolerances()
    except ValueError as exc:
        return str(exc)
    if algorithm not in measured:
        return (
            f"{algorithm} was not measured: run python benchmarks/rounding_spread.py "
            f"--only {algorithm}"
        )
    return measured[algorithm]


def equivalence_row(algorithm: str, device: str, tmp: str) -> dict[str, Any]:
    row: dict[str, Any] = {"algorithm": algorithm}
    t0 = time.perf_counter()
    tol = tolerance_of(algorithm)
    if isinstance(tol, Tolerance):
        row["tolerance"] = {
            "round1_train_loss": tol.round1_train_loss,
            "last3_accuracy": tol.last3_accuracy,
        }
    try:
        cpu = curve(algorithm, "cpu", "off", tmp)
        row["cpu"] = {
            "accuracy": [round(r["accuracy"], 4) for r in cpu],
            "train_loss": [round(r["train_loss"], 4) for r in cpu],
        }
        row["one_after_another"] = gaps(cpu, curve(algorithm, device, "off", tmp), tol)
        if trains_together(algorithm):
            row["together"] = gaps(cpu, curve(algorithm, device, "vmap", tmp), tol)
    except Exception as exc:  # one algorithm's failure is its row, not the end of the step
        row["verdict"] = f"error: {type(exc).__name__}: {exc}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row
    verdicts = [row[k]["verdict"] for k in ("one_after_another", "together") if k in row]
    row["verdict"] = next((v for v in verdicts if v != "ok"), "ok")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


# ---------------------------------------------------------------------------- step 4


SYNTHETIC = "fmnist-shaped-synthetic"


def synthetic_images(
    name: str, shape: tuple[int, ...], source: str, n_train: int = 60000
) -> Dataset:
    """Random images of ``shape`` in 10 classes (``n_train`` + 10,000): a real dataset's
    tensors' shapes, so the same work per step; nothing to learn."""
    gen = torch.Generator().manual_seed(0)
    return Dataset(
        name=name,
        x_train=torch.randn(n_train, *shape, generator=gen),
        y_train=torch.randint(0, 10, (n_train,), generator=gen),
        x_test=torch.randn(10000, *shape, generator=gen),
        y_test=torch.randint(0, 10, (10000,), generator=gen),
        num_classes=10,
        input_shape=shape,
        class_names=[str(i) for i in range(10)],
        source=source,
    )


def synthetic_fmnist() -> Dataset:
    """Random 28x28 grey images in Fashion-MNIST's numbers (60,000 + 10,000, 10 classes)."""
    return synthetic_images(
        SYNTHETIC, (1, 28, 28), "synthetic stand-in made by benchmarks/gpu_check.py"
    )


def throughput_dataset(data_dir: str | None) -> tuple[str, str]:
    """The dataset the throughput table runs on, and what it is, in words."""
    for name in ("fmnist", "mnist"):
        try:
            data = load_dataset(name, data_dir, download=False)
        except FedskewError as exc:
            print(f"gpu_check: throughput: {exc}", flush=True)
            continue
        return name, f"{name} from {data.source}"
    register_dataset(SYNTHETIC, synthetic_fmnist)
    return SYNTHETIC, (
        "a synthetic stand-in of Fashion-MNIST's shape (no copy of Fashion-MNIST or MNIST was "
        "found): the timings hold, the accuracy means nothing"
    )


def data_dir_of(given: str | None) -> str | None:
    """Where the throughput data is looked for first: ``given``, else the checkout's data/
    (the folder a GPU machine gets carried to it; fedskew's loader does not look there)."""
    if given:
        return given
    carried = ROOT / "data"
    return str(carried) if carried.is_dir() else None


def throughput(args: argparse.Namespace, dry_run: bool) -> dict[str, Any]:
    data_dir = data_dir_of(args.data_dir)
    dataset, described = throughput_dataset(data_dir)
    tp = ["--device", args.device, "--dataset", dataset]
    if args.flower:
        tp.append("--flower")
    if dry_run:
        tp += ["--epochs", "1", "--rounds", "1", "--bare-steps", "20", "--pairs", "1"]
    if data_dir:
        tp += ["--data-dir", data_dir]
    result = clients_together.measure(clients_together.parser().parse_args(tp))
    command = "python benchmarks/clients_together.py " + shlex.join(tp)
    return {"dataset": described, "result": result, "command": command}


# ---------------------------------------------------------------------------- Markdown


def _list(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def markdown(data: dict[str, Any], red: list[str]) -> str:
    steps = {e["step"]: e for e in data["steps"]}
    env = steps.get("environment", {}).get("facts", {})
    title = env.get("device_name", "device not read yet")
    lines = [f"# GPU check: {title}", ""]
    lines.append(f"Written by `{data['command']}` on {data['date']}.")
    if env:
        machine = env.get("machine", {})
        lines += [
            "",
            f"- device: {env.get('device')} ({env.get('device_name')}"
            + (f", {env['device_memory_gib']} GiB" if "device_memory_gib" in env else "")
            + ")",
            f"- torch {env.get('torch')}"
            + (f", CUDA {env['cuda']}, cuDNN {env['cudnn']}" if "cuda" in env else ""),
            f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores, "
            f"{machine.get('memory_gib')} GiB, Python {machine.get('python')}",
            f"- code: commit {env.get('commit')}"
            + (" with uncommitted changes" if env.get("uncommitted_changes") else ""),
        ]
    if data["dry_run"]:
        lines += [
            "",
            "**Dry run on the CPU**: the CPU stands in for the device; it checks this script, "
            "not a GPU.",
        ]
    lines += ["", "## Steps", "", "| step | status | seconds |", "|---|---|---:|"]
    for e in data["steps"]:
        status = e["status"] if e["status"] == "ok" else f"**{e['status']}**"
        if "error" in e:
            status += f": {e['error'][:160]}"
        lines.append(f"| {e['step']} | {status} | {e.get('seconds', '')} |")
    verdict = "all rows green" if not red else f"{len(red)} red row(s): " + "; ".join(red[:20])
    lines += ["", f"Result: {verdict}."]

    tests = steps.get("cuda tests")
    if tests is not None:
        lines += ["", "## CUDA tests", ""]
        lines.append(
            "tests/test_device.py and tests/test_together.py, the cases on cuda: "
            f"{tests['status']}, {tests.get('summary', '')}"
        )
        lines += [f"- {x}" for x in tests.get("failed", [])]

    eq = steps.get("equivalence")
    if eq is not None:
        lines += [
            "",
            "## CPU and device curves, per algorithm",
            "",
            f"digits, resnet18 (width 8, BatchNorm), IID over {SETTING['num_clients']} "
            f"clients ({SETTING['clients_per_round']} per round), {ROUNDS} rounds, one local "
            f"epoch, lr {SETTING['lr']}, momentum {SETTING['momentum']}, seed 0, fp32, TF32 off. "
            f"Each device curve against the CPU's: {tolerances()}. Accuracy per round.",
            "",
            "| algorithm | CPU | device, one after another | device, together | gaps: round 1 "
            "train_loss / last 3 accuracy / any round's accuracy (not judged) | tolerance: "
            "round 1 / last 3 | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in eq.get("rows", []):
            tol = row.get("tolerance")
            tol_text = (
                f"{tol['round1_train_loss']:.1%} / {tol['last3_accuracy']:.3f}" if tol else "none"
            )
            if "cpu" not in row:
                lines.append(
                    f"| {row['algorithm']} | | | | | {tol_text} | **{row['verdict'][:160]}** |"
                )
                continue
            cells = []
            gap_text = []
            for key in ("one_after_another", "together"):
                side = row.get(key)
                if side is None:
                    cells.append("not plain: one after another" if key == "together" else "")
                    continue
                if "accuracy" not in side:
                    cells.append(side["verdict"])
                    continue
                cells.append(_list(side["accuracy"]))
                gap_text.append(
                    f"{side['round1_train_loss_gap']:.2%} / {side['last3_accuracy_gap']:.3f} / "
                    f"{side['max_accuracy_gap']:.3f}"
                )
            verdict = row["verdict"] if row["verdict"] == "ok" else f"**{row['verdict']}**"
            lines.append(
                f"| {row['algorithm']} | {_list(row['cpu']['accuracy'])} | {cells[0]} | "
                f"{cells[1]} | {'; '.join(gap_text)} | {tol_text} | {verdict} |"
            )

    tp = steps.get("throughput")
    if tp is not None and "result" in tp:
        lines += ["", "## Throughput", "", f"Data: {tp['dataset']}.", ""]
        text = clients_together.markdown(tp["result"], tp["command"])
        lines += text.split("\n", 2)[2].splitlines()  # without its title
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the dry run")
    p.add_argument("--tests-log", default=None)
    p.add_argument("--tests-rc", type=int, default=None)
    p.add_argument("--flower", action="store_true", help="Flower's simulation in the table")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--only", default=None, help="comma-separated algorithms (default: all)")
    p.add_argument(
        "--data-dir", default=None, help="where Fashion-MNIST is (default: data/ if it exists)"
    )
    p.add_argument("--out", default=None, help="the .md to write (a .json goes beside it)")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except FedskewError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    dry_run = device.type == "cpu"
    default = "benchmarks/out/gpu_check_dryrun.md" if dry_run else "benchmarks/results/gpu_check.md"
    out = Path(args.out) if args.out else ROOT / default
    command = "python benchmarks/gpu_check.py " + shlex.join(argv or sys.argv[1:])
    report = Report(out, command, dry_run)
    report.step("environment", lambda: environment(device))
    report.step("cuda tests", lambda: cuda_tests(args.tests_log, args.tests_rc))

    def equivalence_step() -> dict[str, Any]:
        entry = report.data["steps"][-1]
        entry["rows"] = []
        only = [a.strip() for a in args.only.split(",")] if args.only else None
        algorithms = list(ALGORITHMS) if only is None else only
        with tempfile.TemporaryDirectory() as tmp:
            for algorithm in algorithms:
                row = equivalence_row(algorithm, args.device, tmp)
                entry["rows"].append(row)
                report.write()
                print(f"equivalence {algorithm}: {row['verdict']} ({row['seconds']} s)", flush=True)
        return {}

    report.step("equivalence", equivalence_step)
    if args.skip_throughput:
        report.data["steps"].append({"step": "throughput", "status": "skipped"})
        report.write()
    else:
        report.step("throughput", lambda: throughput(args, dry_run))
    print(report.out.read_text())
    return 1 if report.red() else 0


if __name__ == "__main__":
    raise SystemExit(main())
