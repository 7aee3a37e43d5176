"""What the requested metrics cost, and how much the feature subsample moves them.

FedAvg on CIFAR-10 (the default CNN), 10 clients, Dirichlet 0.5, 4 per round, 1 local epoch,
R rounds, with --feature-metrics-every 1 --local-risk-every 1 --tsne. Reported:

* per evaluation, from the metrics lines: feature_seconds (features of the subsample, k-means,
  NMI, silhouette), local_risk_seconds per local model, next to the round's training seconds;
  the t-SNE at the end;
* for the final global model: NMI and silhouette on the whole test set and on 10 seeded
  subsamples each of 500, 1000, 2000 and 5000 samples (mean, standard deviation, seconds), which
  is what the subsample size of fedskew.metrics.features rests on;
* k-means + silhouette seconds on random 512-d features (ResNet-18's width) for 2000 samples.

    python benchmarks/feature_metrics_cost.py [--rounds 3] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.assembly.prepare import new_model, prepare  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.rng import numpy_rng  # noqa: E402
from fedskew.metrics.features import (  # noqa: E402
    FEATURE_SAMPLE,
    body_features,
    feature_quality,
    feature_sample,
    tsne_embedding,
)
from fedskew.runs.checkpoint import read_checkpoint  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402
from fedskew.training.local import set_arrays  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = (500, 1000, 2000, 5000)
DRAWS = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "feature_metrics_cost"))
    args = ap.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ExperimentConfig(
            dataset="cifar10", data_dir=args.data_dir, download=False, num_clients=10,
            clients_per_round=4, partition_params={"beta": 0.5}, rounds=args.rounds,
            local_epochs=1, batch_size=64, lr=0.01, workers=0, quiet=True, out_dir=tmp,
            name="cost", feature_metrics_every=1, local_risk_every=1, tsne=True,
        )  # fmt: skip
        started = time.perf_counter()
        folder, summary = run(cfg)
        wall = time.perf_counter() - started
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        arrays = read_checkpoint(folder / "checkpoint.npz").server["global_arrays"]
        source = json.loads((folder / "processes.jsonl").read_text().splitlines()[0]).get(
            "data_source", "not recorded"
        )
    per_round = [
        {
            "round": r["round"],
            "train_seconds": r["seconds"],
            "eval_seconds": r.get("eval_seconds"),
            "feature_seconds": r["feature_seconds"],
            "local_risk_seconds": r["local_risk_seconds"],
            "local_models": r["local_risk_models"],
            "feature_nmi": r["feature_nmi"],
            "feature_silhouette": r["feature_silhouette"],
            "local_risk": r["local_risk"],
            "accuracy": r["accuracy"],
        }
        for r in rows
    ]
    tsne_seconds = wall - sum(
        r["seconds"] + r.get("eval_seconds", 0) + r["feature_seconds"] + r["local_risk_seconds"]
        for r in rows
    )  # an upper bound: also holds data loading and the run folder's writes

    prep = prepare(cfg)
    model = new_model(prep)
    set_arrays(model, arrays)
    x, y = prep.dataset.x_test, prep.dataset.y_test.numpy()
    t0 = time.perf_counter()
    features = body_features(model, x)
    full_feature_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = feature_quality(features, y, prep.dataset.num_classes, cfg.seed)
    full_seconds = time.perf_counter() - t0
    spread = []
    for size in SIZES:
        nmi, sil, secs = [], [], []
        for draw in range(DRAWS):
            idx = np.sort(numpy_rng(draw, purpose="bench").choice(len(y), size, replace=False))
            t0 = time.perf_counter()
            q = feature_quality(features[idx], y[idx], prep.dataset.num_classes, cfg.seed)
            secs.append(time.perf_counter() - t0)
            nmi.append(q.nmi)
            sil.append(q.silhouette)
        spread.append(
            {
                "size": size,
                "nmi_mean": statistics.mean(nmi),
                "nmi_std": statistics.stdev(nmi),
                "silhouette_mean": statistics.mean(sil),
                "silhouette_std": statistics.stdev(sil),
                "seconds_mean": statistics.mean(secs),
            }
        )
    sample = feature_sample(len(y), cfg.seed)
    t0 = time.perf_counter()
    tsne_embedding(features[sample], cfg.seed)
    tsne_alone = time.perf_counter() - t0
    wide = np.random.default_rng(0).normal(size=(FEATURE_SAMPLE, 512)).astype(np.float32)
    t0 = time.perf_counter()
    feature_quality(wide, y[sample], prep.dataset.num_classes, cfg.seed)
    wide_seconds = time.perf_counter() - t0

    result = {
        "setting": "FedAvg, CIFAR-10, default CNN, 10 clients, Dirichlet 0.5, 4 per round, "
        f"1 local epoch, batch 64, lr 0.01, {args.rounds} rounds, seed 0",
        "data_source": source,
        "model": summary["model"],
        "feature_dim": int(features.shape[1]),
        "torch_threads": torch.get_num_threads(),
        "machine": machine_facts(),
        "load_average_1min_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        "per_round": per_round,
        "tsne_seconds_alone": round(tsne_alone, 2),
        "tsne_and_overhead_seconds_in_run": round(tsne_seconds, 2),
        "full_test_set": {
            "samples": len(y),
            "features_seconds": round(full_feature_seconds, 3),
            "nmi": full.nmi,
            "silhouette": full.silhouette,
            "seconds": round(full_seconds, 2),
        },
        "subsamples": spread,
        "kmeans_silhouette_512d_2000_seconds": round(wide_seconds, 2),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [
        "# Cost of the requested metrics (feature quality, local risk, t-SNE)",
        "",
        f"Generated by `benchmarks/feature_metrics_cost.py`. {r['setting']}; data: "
        f"{r['data_source']}; model {r['model']} (features of width {r['feature_dim']}); "
        f"{r['torch_threads']} torch threads; machine: "
        + ", ".join(f"{k} {v}" for k, v in r["machine"].items())
        + f". Load average (1 min) before and after: {r['load_average_1min_before_after']}: "
        "other jobs shared the 2 cores, so read the seconds against each other.",
        "",
        "## Per evaluation, in the run",
        "",
        "| round | training s | evaluation s | feature metrics s | local risk s (models) "
        "| NMI | silhouette | local risk | accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["per_round"]:
        lines.append(
            f"| {p['round']} | {p['train_seconds']:.2f} | {p['eval_seconds']:.2f} | "
            f"{p['feature_seconds']:.2f} | {p['local_risk_seconds']:.2f} ({p['local_models']}) "
            f"| {p['feature_nmi']:.3f} | {p['feature_silhouette']:.3f} | "
            f"{p['local_risk']:.3f} | {p['accuracy']:.3f} |"
        )
    f = r["full_test_set"]
    lines += [
        "",
        f"t-SNE of the {FEATURE_SAMPLE}-sample features: {r['tsne_seconds_alone']:.1f} s "
        f"(measured alone after the run).",
        f"k-means + NMI + silhouette on {FEATURE_SAMPLE} random 512-d features (ResNet-18's "
        f"width): {r['kmeans_silhouette_512d_2000_seconds']:.2f} s.",
        "",
        "## Subsample size: final global model, 10 seeded subsamples per size",
        "",
        f"Whole test set ({f['samples']} samples): NMI {f['nmi']:.4f}, silhouette "
        f"{f['silhouette']:.4f}, {f['seconds']:.1f} s (features {f['features_seconds']:.2f} s).",
        "",
        "| samples | NMI mean | NMI std | silhouette mean | silhouette std | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for s in r["subsamples"]:
        lines.append(
            f"| {s['size']} | {s['nmi_mean']:.4f} | {s['nmi_std']:.4f} | "
            f"{s['silhouette_mean']:.4f} | {s['silhouette_std']:.4f} | {s['seconds_mean']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
