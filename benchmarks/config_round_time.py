"""Time per round of the paper configs in configs/, measured on this machine's CPU.

    python benchmarks/config_round_time.py                 # every paper config
    python benchmarks/config_round_time.py configs/fedcme-fmnist.toml --no-check

A paper round is long on a CPU (FedFM's ResNet-18: 10 clients x 5,000 samples x 10 epochs
= 500,000 sample-epochs), so it is measured in parts and extrapolated. For each group of
settings with the same data, model and clients (the partition does not change the work per
sample), FedAvg and the paper's own method run with the configuration's model, batch size,
number of clients and method, on a dataset of the same image size and classes, for 3
rounds: once with 1 local epoch and once with 2. Both runs train the same clients (the
clients of a round are drawn from the seed alone), holding m samples each (a partition
file), so the difference in rounds 2 and 3 (round 1 is the warm-up) is the cost of one
epoch of those samples, and what remains of the 1-epoch round is the per-round work that
does not repeat per epoch (FedFM's anchor pass, FedACD's confusion matrices, FedCME's
exchange). A short probe chooses the clients per round and m so that a 1-epoch round takes
about TARGET_SECONDS (or the configuration's own round, where that is cheap). Then

    seconds per round = E * (2-epoch round / 2 / its samples) * samples per round + evaluation

which counts the per-round work that does not repeat per epoch E/2 times instead of once (an
overestimate by that work's share; the 1-epoch round splits the time into epoch and rest, a
difference of two timings, shown for information),
with samples per round = official training samples x clients per round / clients (the mean)
and evaluation = the measured evaluation time per test sample x the official test size.
The data are random pixels written in the official on-disk format (same image size and
classes, so the same work per sample; a small test set keeps the evaluations short). One
setting is also run at full size on the real data (--check) for 2 rounds, to show how far
the extrapolation is from a measured round.

Writes results/config_round_time.json and .md, and the "time per round" block of each
config file it measured (between its marker lines), so the numbers there are this script's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.apps import compare
from fedskew.core.machine import machine_facts

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAPER_CONFIGS = [
    "configs/fedfm-cifar10.toml", "configs/fedfm-cifar100.toml", "configs/fedfm-missing.toml",
    "configs/fedacd-cifar10.toml", "configs/fedacd-cifar100.toml",
    "configs/fedacd-tinyimagenet.toml", "configs/fedcme-fmnist.toml",
    "configs/fedcme-cifar10.toml",
]  # fmt: skip
PAPER_METHODS = ("fedfm", "fedacd", "fedcme")
BEGIN = "# --- time per round (written by benchmarks/config_round_time.py; do not edit by hand) ---"
END = "# --- end of time per round ---"
# Before each measurement, wait (at most WAIT_SECONDS) for the 1-minute load average to fall
# below MAX_LOAD: other work on a shared machine slows the measured rounds.
MAX_LOAD = 1.5 * (os.cpu_count() or 1)
WAIT_SECONDS = 1200
# The measured 1-epoch round's length, and the client size of the probe that chooses it.
TARGET_SECONDS = 15
PROBE_SIZE = 128
GROUP_KEYS = ("dataset", "model", "model_options", "num_clients", "clients_per_round",
              "local_epochs", "batch_size", "augment", "precision")  # fmt: skip


# --------------------------------------------------------------------------- stand-ins

# Official (training, test) sizes, for the extrapolation to the paper's rounds.
OFFICIAL = {
    "mnist": (60_000, 10_000), "fmnist": (60_000, 10_000), "cifar10": (50_000, 10_000),
    "cifar100": (50_000, 10_000), "tinyimagenet": (100_000, 10_000),
}  # fmt: skip
STANDIN = {"train": 4_000, "test": 500}  # sizes of the random stand-ins


def _idx(path: Path, array: np.ndarray) -> None:
    magic = 0x0803 if array.ndim == 3 else 0x0801
    header = np.array([magic, *array.shape], dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def standin(dataset: str, folder: Path) -> Path:
    """Random pixels and balanced labels in the dataset's official on-disk format."""
    rng = np.random.default_rng(0)
    n_train, n_test = STANDIN["train"], STANDIN["test"]
    folder.mkdir(parents=True, exist_ok=True)
    if dataset in ("mnist", "fmnist"):
        for split, n in (("train", n_train), ("t10k", n_test)):
            _idx(folder / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
            _idx(folder / f"{split}-labels-idx1-ubyte", np.arange(n) % 10)
    elif dataset in ("cifar10", "cifar100"):
        classes = 10 if dataset == "cifar10" else 100
        d = folder / ("cifar-10-batches-bin" if classes == 10 else "cifar-100-binary")
        d.mkdir(exist_ok=True)
        files = (
            [(f"data_batch_{i}.bin", n_train // 5) for i in range(1, 6)]
            + [("test_batch.bin", n_test)]
            if classes == 10
            else [("train.bin", n_train), ("test.bin", n_test)]
        )
        labels = 1 if classes == 10 else 2
        for name, n in files:
            fine = np.arange(n) % classes
            records = np.empty((n, labels + 3072), dtype=np.uint8)
            records[:, labels - 1] = fine
            if labels == 2:
                records[:, 0] = fine // 5
            records[:, labels:] = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
            (d / name).write_bytes(records.tobytes())
    elif dataset == "tinyimagenet":
        from PIL import Image

        d = folder / "tiny-imagenet-200"
        wnids = [f"n{i:08d}" for i in range(200)]
        (d / "val" / "images").mkdir(parents=True, exist_ok=True)
        (d / "wnids.txt").write_text("\n".join(wnids) + "\n")
        annotations = []
        for i in range(n_train):
            wnid = wnids[i % 200]
            images = d / "train" / wnid / "images"
            images.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{wnid}_{i}.JPEG")
        for i in range(n_test):
            name = f"val_{i}.JPEG"
            pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(d / "val" / "images" / name)
            annotations.append(f"{name}\t{wnids[i % 200]}\t0\t0\t63\t63")
        (d / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
    else:
        raise SystemExit(f"no stand-in for {dataset}")
    return folder


def partition_file(path: Path, num_clients: int, size: int, n_train: int) -> Path:
    """num_clients clients of ``size`` samples each (overlapping: a small stand-in)."""
    clients = [[(k * size + i) % n_train for i in range(size)] for k in range(num_clients)]
    path.write_text(json.dumps(clients))
    return path


# ------------------------------------------------------------------------- measuring


def run_rounds(values: dict[str, Any], out: Path, threads: int) -> list[dict]:
    """One `fedskew run` process; its metrics lines."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{values['name']}.json"
    config.write_text(json.dumps({**values, "out_dir": str(out), "quiet": True}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [sys.executable, "-m", "fedskew", "run", "-c", str(config)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{values['name']} failed: {proc.stderr.strip()[-800:]}")
    lines = (out / values["name"] / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def wait_for_quiet(max_load: float, timeout: float) -> float:
    """Wait until the 1-minute load average is below ``max_load`` (the machine is shared),
    at most ``timeout`` seconds; the load average when the wait ended."""
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(20)
    return os.getloadavg()[0]


def measure(values: dict, scratch: Path, threads: int) -> dict:
    """The per-sample costs of one method in one setting group, and the paper's round."""
    load_before = wait_for_quiet(MAX_LOAD, WAIT_SECONDS)
    dataset = values["dataset"]
    train, test = OFFICIAL[dataset]
    data_dir = scratch / f"data-{dataset}"
    if not data_dir.exists():
        standin(dataset, data_dir)
    per_round, num_clients = values["clients_per_round"], values["num_clients"]
    mean_size = train // num_clients
    name = values["name"]
    base = {**values, "data_dir": str(data_dir), "rounds": 3, "eval_every": 3,
            "checkpoint_every": 0, "workers": 0, "partition_overlap": True}  # fmt: skip
    if values["algorithm"] == "fedfm":
        base["params"] = {**values.get("params", {}), "start_round": 0}  # anchors from round 1

    def rounds(clients: int, size: int, epochs: int, tag: str) -> dict:
        part = partition_file(scratch / f"{name}-{tag}-partition.json", num_clients, size,
                              STANDIN["train"])  # fmt: skip
        cfg = {**base, "partition_file": str(part), "clients_per_round": clients,
               "local_epochs": epochs, "name": f"{name}-{tag}"}  # fmt: skip
        rows = run_rounds(cfg, scratch, threads)[1:]  # round 1 is the warm-up
        return {
            "clients": [r["clients"] for r in rows],
            "samples": sum(r["samples"] for r in rows) / len(rows),
            "seconds": sum(r["seconds"] for r in rows) / len(rows),
            "eval_seconds": sum(r.get("eval_seconds", 0.0) for r in rows),  # the last round's
        }

    t0 = time.perf_counter()
    probe = rounds(min(2, per_round), PROBE_SIZE, 1, "probe")
    per_sample = probe["seconds"] / probe["samples"]
    # The probe's small clients overstate the cost per sample (fixed costs per client), so a
    # configuration round predicted up to 3 x the target is still measured whole.
    if per_round * mean_size * per_sample <= 3 * TARGET_SECONDS:
        clients, size = per_round, mean_size  # the configuration's own round is cheap
    else:
        clients = min(2, per_round)
        size = int(min(mean_size, max(PROBE_SIZE, TARGET_SECONDS / per_sample / clients)))
    r1 = rounds(clients, size, 1, "e1")
    r2 = rounds(clients, size, 2, "e2")
    assert r1["clients"] == r2["clients"], "the two runs trained different clients"
    raw = {
        "measured_clients_per_round": clients,
        "measured_client_size": size,
        "measured_samples": r1["samples"],  # a round's client samples (mean of rounds 2-3)
        "probe_seconds": probe["seconds"],
        "seconds_e1": r1["seconds"],
        "seconds_e2": r2["seconds"],
        "eval_seconds_per_sample": (r1["eval_seconds"] + r2["eval_seconds"]) / 2 / STANDIN["test"],
        "samples_per_round": train * per_round / num_clients,
        "official_test": test,
        "measurement_seconds": time.perf_counter() - t0,
        "load_before": load_before,
        "load_average": os.getloadavg()[0],
    }
    return derive(raw, values["local_epochs"])


def derive(raw: dict, epochs: int) -> dict:
    """The paper round from the raw measurement: the 2-epoch round's time per sample-epoch
    x E x the paper's samples per round, plus the evaluation. Its per-round work that does
    not repeat per epoch is counted E/2 times instead of once (an overestimate, by that
    work's share); the 1-epoch round only splits the time into epoch and rest, shown
    for information (a difference of two timings, so the noisier figure)."""
    s = raw["measured_samples"]
    t1, t2 = raw["seconds_e1"], raw["seconds_e2"]
    per_sample_epoch = t2 / (2 * s)
    train_seconds = epochs * per_sample_epoch * raw["samples_per_round"]
    eval_seconds = raw["eval_seconds_per_sample"] * raw["official_test"]
    return {
        **raw,
        "seconds_per_sample_epoch": per_sample_epoch,
        "epoch_seconds_per_sample": (t2 - t1) / s,
        "rest_seconds_per_sample": (2 * t1 - t2) / s,
        "train_seconds_per_round": train_seconds,
        "eval_seconds_per_round": eval_seconds,
        "seconds_per_round": train_seconds + eval_seconds,
    }


def groups_of(file: str) -> list[tuple[str, str, dict[str, dict]]]:
    """(setting, setting names of the group, {method: run values}) per setting group, for
    FedAvg and the paper's method."""
    grid = compare.grid_from(compare.read_file(ROOT / file), file, {}, None, {})
    runs = compare.plan(grid)
    paper = next(m for m, v in grid.methods.items() if v["algorithm"] in PAPER_METHODS)
    chosen = ["fedavg", paper] if "fedavg" in grid.methods else [paper]
    seen: dict[str, tuple[str, list[str], dict]] = {}
    for r in runs:
        if r.seed != grid.seeds[0] or r.method not in chosen:
            continue
        key = json.dumps({k: r.values.get(k) for k in GROUP_KEYS}, sort_keys=True, default=str)
        entry = seen.setdefault(key, (r.setting, [], {}))
        if r.setting not in entry[1]:
            entry[1].append(r.setting)
        if r.setting == entry[0]:
            entry[2][r.method] = {**r.values, "name": f"{Path(file).stem}-{r.setting}-{r.method}"}
    return [(s, names, methods) for s, names, methods in seen.values()]


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def config_block(entries: list[dict], machine: str) -> list[str]:
    lines = [
        BEGIN,
        f"# Estimated on {machine} from measured partial rounds (one run at a time, all cores;",
        "# load average before each measurement given in the results file;",
        "# benchmarks/results/config_round_time.md says how, and how far a full round was):",
    ]
    for e in entries:
        where = f"setting {e['setting']}" if e["setting"] else "every setting"
        if len(e["settings"]) > 1:
            where = f"settings {', '.join(e['settings'])}"
        lines.append(f"#   {where} (measured on {e['data']}):")
        for method, m in e["methods"].items():
            total = m["seconds_per_round"] * e["rounds"]
            lines.append(
                f"#     {method}: {m['seconds_per_round']:.0f} s per round "
                f"({m['train_seconds_per_round']:.0f} s training, "
                f"{m['eval_seconds_per_round']:.0f} s evaluation); {e['rounds']} rounds: "
                f"{hours(total)} per run"
            )
    lines.append(END)
    return lines


def write_block(file: Path, block: list[str]) -> None:
    lines = file.read_text().splitlines()
    start, end = lines.index(BEGIN), lines.index(END)
    file.write_text("\n".join(lines[:start] + block + lines[end + 1 :]) + "\n")


def check_full_round(scratch: Path, threads: int) -> dict:
    """FedCME's FMNIST setting (K 50, M 20, E 10) at full size for 2 rounds, against the
    estimate made for it."""
    load_before = wait_for_quiet(MAX_LOAD, WAIT_SECONDS)
    file = "configs/fedcme-fmnist.toml"
    setting, _, methods = groups_of(file)[0]
    values = {**methods["fedavg"], "rounds": 2, "checkpoint_every": 0, "workers": 0,
              "name": "check-fedavg"}  # fmt: skip
    rows = run_rounds(values, scratch, threads)
    r = rows[1]
    return {
        "file": file,
        "setting": setting,
        "method": "fedavg",
        "round": 2,
        "samples": r["samples"],
        "train_seconds": r["seconds"],
        "eval_seconds": r["eval_seconds"],
        "seconds": r["seconds"] + r["eval_seconds"],
        "load_before": load_before,
        "load_average": os.getloadavg()[0],
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    out = [
        "# Time per round of the paper configs",
        "",
        f"Produced by `python benchmarks/config_round_time.py` on {m['cpu']}, {m['cores']} "
        f"cores, {m['memory_gib']} GiB, torch {m['torch']}, {result['threads']} torch threads, "
        f"one measurement at a time; {result['started']} to {result['finished']}. The machine "
        "is shared: each measurement waited (up to "
        f"{WAIT_SECONDS // 60} min) for the 1-minute load average to fall below "
        f"{MAX_LOAD:g}, and the load before and after it is given; a load above "
        f"{m['cores']} means other work competed for the cores and the times are too long.",
        "",
        "How (the script's docstring says more): each row ran the configuration's model, "
        "batch size, clients and method for 3 rounds with 1 and with 2 local epochs on the same "
        "clients (measured: clients per round x m samples each), on random pixels in the "
        f"dataset's official format ({STANDIN['train']} training and {STANDIN['test']} test "
        "images), rounds 2 and 3 counted (round 1 is the warm-up). Seconds per round = E x "
        "(the 2-epoch round's seconds per sample-epoch) x mean samples per round (official "
        "training set x clients per round / clients) + the evaluation time per test sample x "
        "the official test set. That counts the work that does not repeat per epoch E/2 times "
        "instead of once: an overestimate by its share. The epoch/rest split is the "
        "difference of the 1- and 2-epoch rounds, a difference of two timings: it shows how "
        "noisy the timings were (a negative rest is noise). The check at the end compares the "
        "estimate with a round measured at full size on the real data.",
        "",
        "| config | settings | method | E | measured: clients x m | samples per round | "
        "ms per sample-epoch (2-epoch round) | split: epoch, rest (ms per sample) | "
        "training s/round | evaluation s/round | **s per round** | load before, after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in result["entries"]:
        for method, r in e["methods"].items():
            out.append(
                f"| {e['file']} | {', '.join(e['settings'])} | {method} | "
                f"{e['local_epochs']} | {r['measured_clients_per_round']} x "
                f"{r['measured_client_size']} | {r['samples_per_round']:.0f} | "
                f"{1000 * r['seconds_per_sample_epoch']:.3f} | "
                f"{1000 * r['epoch_seconds_per_sample']:.3f}, "
                f"{1000 * r['rest_seconds_per_sample']:.3f} | "
                f"{r['train_seconds_per_round']:.0f} | {r['eval_seconds_per_round']:.1f} | "
                f"**{r['seconds_per_round']:.0f}** | {r['load_before']:.1f}, "
                f"{r['load_average']:.1f} |"
            )
    check = result.get("check")
    if check:
        est = next(
            e["methods"]["fedavg"]
            for e in result["entries"]
            if e["file"] == check["file"] and e["setting"] == check["setting"]
        )
        same = est["seconds_per_sample_epoch"] * check["samples"] + est["eval_seconds_per_round"]
        out += [
            "",
            f"Check at full size: {check['file']}, setting {check['setting']}, "
            f"{check['method']}, round {check['round']} measured {check['seconds']:.1f} s "
            f"({check['train_seconds']:.1f} s training on {check['samples']} sample-epochs, "
            f"{check['eval_seconds']:.1f} s evaluation; load average "
            f"{check['load_before']:.1f} before, {check['load_average']:.1f} after). The "
            f"per-sample estimate for that round's own clients is {same:.1f} s "
            f"({same / check['seconds']:.2f}x the measured round); "
            f"for a round of the mean size it is {est['seconds_per_round']:.1f} s (a round's "
            "clients hold more or fewer samples than the mean).",
        ]
    return "\n".join(out) + "\n"


def main() -> None:
    global MAX_LOAD, WAIT_SECONDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=PAPER_CONFIGS)
    ap.add_argument("--no-check", action="store_true", help="skip the full-size check")
    ap.add_argument("--threads", type=int, default=compare.available_cores())
    ap.add_argument("--max-load", type=float, default=MAX_LOAD, help="wait for a load below")
    ap.add_argument("--wait", type=float, default=WAIT_SECONDS, help="longest wait (s)")
    ap.add_argument(
        "--report-only", action="store_true",
        help="measure nothing: rewrite the .md and the configs' blocks from the .json",
    )  # fmt: skip
    args = ap.parse_args()
    MAX_LOAD, WAIT_SECONDS = args.max_load, int(args.wait)
    os.chdir(ROOT)  # config paths and the shared data are found from the repository root
    out = HERE / "results" / "config_round_time"
    if args.report_only:
        result = json.loads(out.with_suffix(".json").read_text())
        write_results(result, out)
        return
    facts = machine_facts()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    entries, measured = [], {}
    result: dict[str, Any] = {"machine": facts, "threads": args.threads, "started": started,
                              "finished": started, "entries": entries, "check": None}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fedskew-round-time-") as tmp:
        scratch = Path(tmp)
        for file in args.configs:
            file_entries = []
            for setting, names, methods in groups_of(file):
                first = next(iter(methods.values()))
                what = f"random pixels in the official {first['dataset']} format"
                entry = {"file": file, "setting": setting, "settings": names, "data": what,
                         "official_sizes": OFFICIAL[first["dataset"]],
                         "local_epochs": first["local_epochs"], "rounds": first["rounds"],
                         "methods": {}}  # fmt: skip
                for method, values in methods.items():
                    key = json.dumps(
                        {k: values.get(k) for k in (*GROUP_KEYS, "algorithm", "params")},
                        sort_keys=True, default=str,
                    )  # fmt: skip
                    if key not in measured:
                        measured[key] = measure(values, scratch, args.threads)
                        r = measured[key]
                        print(f"{file} {setting} {method}: {r['seconds_per_round']:.0f} s/round "
                              f"(measured in {r['measurement_seconds']:.0f} s, load "
                              f"{r['load_before']:.1f} before, {r['load_average']:.1f} after)",
                              flush=True)  # fmt: skip
                    entry["methods"][method] = measured[key]
                file_entries.append(entry)
            entries += file_entries
            result["entries"] = entries
            result["finished"] = time.strftime("%Y-%m-%d %H:%M %Z")
            write_results(result, out)  # after every file: a killed run keeps what it measured
        if not args.no_check:
            result["check"] = check_full_round(scratch, args.threads)
            result["finished"] = time.strftime("%Y-%m-%d %H:%M %Z")
            write_results(result, out)


def write_results(result: dict, out: Path) -> None:
    """The .json, the .md and every measured config's block, estimates derived again from
    the raw timings (so that --report-only applies the current estimator)."""
    m = result["machine"]
    machine = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"
    for entry in result["entries"]:
        for method, r in entry["methods"].items():
            r.setdefault("official_test", entry["official_sizes"][1])
            entry["methods"][method] = derive(r, entry["local_epochs"])
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    for file in dict.fromkeys(e["file"] for e in result["entries"]):
        write_block(ROOT / file, config_block([e for e in result["entries"] if e["file"] == file],
                                              machine))  # fmt: skip
    print(f"written: {out}.md, {out}.json and the configs' time-per-round blocks")


if __name__ == "__main__":
    main()
