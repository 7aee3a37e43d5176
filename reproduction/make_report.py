"""Write reproduction/REPRODUCTION.md from the study's run folders.

    python reproduction/make_report.py            # tables, verdicts, provenance
    python reproduction/make_report.py --reports  # also `fedskew compare --report-only` and
                                                  # `fedskew report` for every grid (curves)

Every number comes from the run folders under reproduction/runs/ (written by `fedskew compare
-c reproduction/<grid>.toml`); every verdict is computed here by the rule the document states.
The papers' figures are quoted from docs/algorithms.md and labelled as such.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.apps import compare
from fedskew.apps.class_counts import PartitionCounts, class_names_of
from fedskew.assembly.prepare import load_experiment_data
from fedskew.report.intervals import LEVEL, t_quantile
from fedskew.report.per_class import SAMPLES_DIFFER, minority_majority
from fedskew.report.runs import (
    RunRecord,
    estimated_seconds,
    find_runs,
    machine_spans,
    provenance,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / "runs"
OUT = HERE / "REPRODUCTION.md"
SPREAD_FILE = HERE / "rerun_spread.json"  # written by rerun_spread.py

sys.path.insert(0, str(HERE))  # the study's scripts: the kinds of difference between runs
import rerun_spread  # noqa: E402
from rerun_spread import KINDS, MACHINE, SAME  # noqa: E402

# grid name -> (compare file, what the paper ran: quoted from ALGORITHMS.md)
GRIDS: dict[str, tuple[str, dict[str, str]]] = {
    "fedcme-fmnist": (
        "reproduction/fedcme-fmnist.toml",
        {
            "model": "not stated; proposed simple-cnn (ALGORITHMS.md 1.8 [PROPOSAL])",
            "rounds": "not stated; proposed 100 [PROPOSAL]",
            "local_epochs": "not stated; proposed 10 [PROPOSAL]",
            "clients": "K = 50, M = 20 [PAPER]",
            "data": "FMNIST, Dirichlet 0.1 [PAPER]",
        },
    ),
    "fedcme-cifar10": (
        "reproduction/fedcme-cifar10.toml",
        {
            "model": "not stated; proposed simple-cnn [PROPOSAL]",
            "rounds": "not stated; proposed 100; the number is read at 2/5 of T",
            "local_epochs": "not stated; proposed 10 [PROPOSAL]",
            "clients": "K = 80, M = 30 [PAPER]",
            "data": "CIFAR-10, Dirichlet 0.1 [PAPER]",
        },
    ),
    "fedfm-cifar10": (
        "reproduction/fedfm-cifar10.toml",
        {
            "model": "ResNet-18 with BatchNorm (ALGORITHMS.md 2.6 [CODE])",
            "rounds": "100, launching round T_s = 20",
            "local_epochs": "10",
            "clients": "10, all every round",
            "data": "CIFAR-10, NIID-1 = Dirichlet 0.5",
        },
    ),
    "fedfm-stability": (
        "reproduction/fedfm-stability.toml",
        {
            "model": "ResNet-18 with BatchNorm",
            "rounds": "100, T_s = 20",
            "local_epochs": "10",
            "clients": "10, all every round",
            "data": "CIFAR-10, NIID-1; lam 50 (the paper's choice)",
        },
    ),
    "fedfm-longer": (
        "reproduction/fedfm-longer.toml",
        {
            "model": "ResNet-18 with BatchNorm",
            "rounds": "100, T_s = 20",
            "local_epochs": "10",
            "clients": "10, all every round",
            "data": "CIFAR-10, NIID-1",
        },
    ),
    # The tuned comparison (issue 37): `fedskew tune -c reproduction/fedfm-tuned.toml` writes
    # tuned.json, a compare file of the best values, evaluated on seeds 0-2 into evaluation/.
    "fedfm-tuned/evaluation": (
        "reproduction/runs/fedfm-tuned/tuned.json",
        {
            "model": "ResNet-18 with BatchNorm",
            "rounds": "100, T_s = 20",
            "local_epochs": "10",
            "clients": "10, all every round",
            "data": "CIFAR-10, NIID-1; lam 50, lr 0.01 (the paper's values, not tuned)",
        },
    ),
    "fedacd-cifar10": (
        "reproduction/fedacd-cifar10.toml",
        {
            "model": "'simple CNN as in FedROD', taken to be cnn-cifar (ALGORITHMS.md 3.9)",
            "rounds": "200",
            "local_epochs": "5",
            "clients": "20, 40 % per round",
            "data": "CIFAR-10, Dirichlet 0.3 / 0.1 / 0.05",
        },
    ),
}


@dataclass
class Claim:
    paper: str
    text: str
    quoted: str  # the paper's figure or statement, as ALGORITHMS.md recovers it
    grid: str
    setting: str
    method: str
    against: list[str]  # one method ("above") or several ("best")
    # above: method > against[0]; best: method > every one of against; similar: the mean
    # difference to against[0] within SIMILAR_POINTS
    kind: str = "above"
    metric: str = "accuracy"
    lower_is_better: bool = False  # e.g. a risk: "ahead" then means below
    # How the setting differs from the paper: text, or what writes it from the claim's runs.
    differs: list[Differ] = field(default_factory=list)


# A difference from the paper that the runs decide (their rounds, launching round, tuned
# values) is written from them when the report is made, not typed in.
Differ = str | Callable[["Claim", "Grid | None"], str]


FM_BASELINES = ["fedavg", "fedprox", "scaffold", "fednova", "moon", "feddyn"]
TABLE_II_BEST = (
    "FedFM best of FedAvg, FedProx, SCAFFOLD, FedNova, MOON, FedDyn on all six tasks (Table II)"
)
ACD_BASELINES = [
    "fedavg",
    "fedprox",
    "fednova",
    "fedrod",
    "fedlc",
    "fedntd",
    "feddecorr",
    "fednh",
    "creff",
]
NIID1_MODELS = (("bn", "with BatchNorm"), ("plain", "without normalisation"))
# Where the remedies are judged: NIID-1 with and without normalisation, and the two other
# Table II tasks with BatchNorm.
REMEDY_SETTINGS = (
    *NIID1_MODELS,
    ("bn-niid2", "with BatchNorm, NIID-2"),
    ("bn-missing1", "with BatchNorm, missing-1"),
)
SIMILAR_POINTS = 1.0  # "similar" claims: the mean paired difference within this many points

CME_DIFF = [
    "10 rounds of 2 local epochs instead of the proposed 100 of 10",
    "the model, epochs and rounds are [PROPOSAL] choices (the paper does not state them)",
]
CME_CIFAR_DIFF = ["30 rounds of 2 local epochs instead of the proposed 100 of 10", *CME_DIFF[1:]]

def fm_schedule(claim: Claim, grid: Grid | None) -> str:
    """'R rounds of E local epochs instead of 100 of 10 (T_s S instead of 20)', read from the
    configurations of the claim's runs (of the grid's plan before any has finished); the
    launching round only where a method of the claim has one (FedFM, FedFM-Lite, a plug-in)."""
    runs = claim_records(claim, grid)
    if runs:
        configs = [(r.config, r.resolved.get("algorithm_params") or {}) for r in runs]
    elif grid is not None:
        base, methods = grid.manifest.get("base", {}), grid.manifest.get("methods", {})
        configs = [
            ({**base, **methods.get(m, {})}, {})
            for m in (claim.method, *claim.against)
        ]  # fmt: skip
    else:
        return "scaled down from 100 rounds of 10 local epochs (not run yet)"
    rounds = distinct(c.get("rounds") for c, _ in configs)
    epochs = distinct(c.get("local_epochs") for c, _ in configs)
    starts = distinct(start_round(c, a) for c, a in configs)
    text = (
        f"{rounds} rounds of {epochs} local epoch{'' if epochs == '1' else 's'} instead of "
        "100 of 10"
    )
    return text + (f" (T_s {starts} instead of 20)" if starts else "")


def start_round(config: dict[str, Any], algorithm_params: dict[str, Any]) -> Any:
    """A run's launching round T_s (0-based): what it resolved (the algorithm's default
    included), else its configuration; None for methods without one."""
    return algorithm_params.get("start_round", (config.get("params") or {}).get("start_round"))


def tuned_values(claim: Claim, grid: Grid | None) -> str:
    """What the tuned runs used, per method: the values of the keys the study searched
    (tune.json's search space), as the claim's run folders record them; tuned.json's where
    no run has finished. With the study's budget, tuning seeds, objective and any
    validation setting tune.json records."""
    study = read_json(tuned_study() / "tune.json") or {}
    tuned = (read_json(tuned_study() / "tuned.json") or {}).get("methods", {})
    space = study.get("search_space") or {
        m: {k: None for k in v if k != "algorithm"} for m, v in tuned.items()
    }
    runs = claim_records(claim, grid)
    parts = []
    for method in (claim.method, *claim.against):
        keys = list(space.get(method) or {})
        if not keys:
            continue
        mine = [r for r in runs if r.method == method]
        values = []
        for key in keys:
            if mine:
                found = distinct(config_value(r.config, r.resolved, key) for r in mine)
            else:
                found = distinct([nested(tuned.get(method, {}), key)])
            values.append(f"{KEY_LABELS.get(key, key.removeprefix('params.'))} {found or '-'}")
        parts.append(f"{method} {', '.join(values)}")
    terms = []
    if study.get("trials_per_method") is not None:
        terms.append(f"{study['trials_per_method']} trials per method")
    if study.get("tuning_seeds") is not None:
        terms.append(f"tuning seeds {study['tuning_seeds']}")
    terms += validation_terms(study)
    if study.get("objective"):
        terms.append(f"objective: {study['objective']}")
    where = "the runs' values" if runs else "tuned.json's values (no evaluation run finished)"
    return (
        f"tuned ({'; '.join(terms) or 'see Tuning'}), {where}: {'; '.join(parts) or '-'}; "
        "the paper's values (lr 0.01, lam 50, T_s 20 of 100) not used"
    )


def validation_terms(study: dict[str, Any]) -> list[str]:
    """How the study held data out for its objective, as tune.json names it (any key with
    'validation' in its name; none in studies made before it could)."""
    return [f"{k.replace('_', ' ')} {v}" for k, v in study.items() if "validation" in k]


# How tune.json's search keys read in the report.
KEY_LABELS = {"params.start_round": "T_s", "params.lam": "lam"}


def nested(values: dict[str, Any], key: str) -> Any:
    """``values["params"]["lam"]`` for key "params.lam" (None where absent)."""
    for part in key.split("."):
        if not isinstance(values, dict):
            return None
        values = values.get(part)
    return values


def config_value(config: dict[str, Any], resolved: dict[str, Any], key: str) -> Any:
    """A run's value of a tuned key: from its configuration, an algorithm parameter left
    at its default from what the run resolved."""
    value = nested(config, key)
    if value is None and key.startswith("params."):
        value = (resolved.get("algorithm_params") or {}).get(key.removeprefix("params."))
    return value


def distinct(values: Any) -> str:
    """The distinct values, in order of first appearance, as text ('' when none): floats
    to 4 significant digits."""
    seen = dict.fromkeys(
        f"{v:.4g}" if isinstance(v, float) else str(v) for v in values if v is not None
    )
    return ", ".join(seen)


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


FM_DIFF: list[Differ] = [
    fm_schedule,
    "simple-cnn instead of ResNet-18",
    "the CIFAR-10 copy is a JPEG re-encoding",
    "clients train on all their data (the official code keeps 20 % for validation)",
]
ACD_DIFF = [
    "10 rounds of 2 local epochs instead of 200 of 5",
    "the model is a [PROPOSAL] reading of 'simple CNN as in FedROD'",
    "the CIFAR-10 copy is a JPEG re-encoding",
]

CLAIMS = [
    Claim(
        "FedCME", "FedCME (mu 0.01) above FedProx (mu 0.01), CIFAR-10, K 80 / M 30",
        "61.83 % vs 56.93 % (+4.90) at 2/5 of T (Table III)",
        "fedcme-cifar10", "", "fedcme-mu0.01", ["fedprox-mu0.01"],
        differs=[*CME_CIFAR_DIFF, "the paper reads its number at 2/5 of T (round 40 of 100)"],
    ),
    *[
        Claim(
            "FedCME", f"FedCME (mu {mu}) best of FedAvg, FedProx, MOON, FedRS, CIFAR-10, "
            "alpha 0.1",
            "CIFAR-10, alpha 0.1: FedCME mu 0.1 best and mu 0.01 second in all four settings "
            "(Table II)",
            "fedcme-cifar10", "", f"fedcme-mu{mu}",
            ["fedavg", "fedprox-mu0.01", "moon", "fedrs-a0.5"], kind="best",
            differs=CME_CIFAR_DIFF,
        )
        for mu in ("0.1", "0.01")
    ],
    Claim(
        "FedCME", "FedCME (mu 0.01) above FedProx (mu 0.01)",
        "61.83 % vs 56.93 % (+4.90) on CIFAR-10, alpha 0.1, K 80 / M 30, at 2/5 of T; "
        "run here at the paper's FMNIST setting, where no number is recovered",
        "fedcme-fmnist", "", "fedcme-mu0.01", ["fedprox-mu0.01"],
        differs=[*CME_DIFF, "the recovered number is on CIFAR-10 (K 80 / M 30), not FMNIST"],
    ),
    Claim(
        "FedCME", "FedCME (mu 0.01) best of FedAvg, FedProx, MOON, FedRS on FMNIST",
        "best in 7 of 8 FMNIST settings (Table II, qualitative)",
        "fedcme-fmnist", "", "fedcme-mu0.01",
        ["fedavg", "fedprox-mu0.01", "moon", "fedrs-a0.5"], kind="best", differs=CME_DIFF,
    ),
    Claim(
        "FedCME", "classifier exchange helps: FedCME above FedCME without exchange",
        "classifier exchange is the main contributor (Table IV, qualitative)",
        "fedcme-fmnist", "", "fedcme-mu0.01", ["fedcme-noexchange"], differs=CME_DIFF,
    ),
    Claim(
        "FedCME", "the alignment term helps: FedCME mu 0.01 above mu 0",
        "L2Loss helps, mainly in the first half of training (Table IV, qualitative)",
        "fedcme-fmnist", "", "fedcme-mu0.01", ["fedcme-mu0"], differs=CME_DIFF,
    ),
    *[
        Claim(
            "FedCME", f"exchanging the classifier above exchanging {what}",
            "exchanging the whole model, or only the extractor, is worse (Table IV)",
            "fedcme-fmnist", "", "fedcme-mu0.01", [method], differs=CME_DIFF,
        )
        for method, what in (("fedcme-body", "the extractor"), ("fedcme-model", "the model"))
    ],
    Claim(
        "FedCME", "one-to-one matching above many-to-one",
        "many-to-one matching is worse (the paper's ablation)",
        "fedcme-fmnist", "", "fedcme-mu0.01", ["fedcme-many-to-one"], differs=CME_DIFF,
    ),
    Claim(
        "FedCME", "matching by evaluation vectors above random pairs",
        "complementary clients are chosen by their evaluation vectors (the method's premise)",
        "fedcme-fmnist", "", "fedcme-mu0.01", ["fedcme-random-matching"], differs=CME_DIFF,
    ),
    *[
        Claim(
            "FedFM", f"FedFM above SCAFFOLD, CIFAR-10 NIID-1, simple-cnn {label}",
            "72.89 ± 0.22 % vs 69.91 % (+2.98), ResNet-18 with BatchNorm (Table II)",
            "fedfm-cifar10", setting, "fedfm", ["scaffold"], differs=FM_DIFF,
        )
        for setting, label in NIID1_MODELS
    ],
    *[
        Claim(
            "FedFM", f"FedFM above FedAvg, CIFAR-10 NIID-1, simple-cnn {label}",
            "about 72 % vs about 66 % (the official code's README [CODE])",
            "fedfm-cifar10", setting, "fedfm", ["fedavg"], differs=FM_DIFF,
        )
        for setting, label in NIID1_MODELS
    ],
    Claim(
        "FedFM", "FedFM above FedAvg, CIFAR-10 NIID-1, ResNet-18 at width 8",
        "about 72 % vs about 66 % (the official code's README [CODE])",
        "fedfm-cifar10", "resnet-w8", "fedfm", ["fedavg"],
        differs=[FM_DIFF[0], "ResNet-18 with 8 instead of 64 channels in its first stage",
                 *FM_DIFF[2:]],
    ),
    Claim(
        "FedFM", "FedFM above FedAvg, CIFAR-10 NIID-1, simple-cnn with BatchNorm, both tuned "
        "with the same budget",
        "about 72 % vs about 66 % (the official code's README [CODE])",
        "fedfm-tuned/evaluation", "", "fedfm", ["fedavg"],
        differs=[*FM_DIFF, tuned_values],
    ),
    Claim(
        "FedFM", "FedFM above SCAFFOLD, CIFAR-10 NIID-2, simple-cnn with BatchNorm",
        "FedFM ahead of SCAFFOLD on all six Table II tasks (margins 2.98-4.97; which margin "
        "is NIID-2 is not confirmed)",
        "fedfm-cifar10", "bn-niid2", "fedfm", ["scaffold"], differs=FM_DIFF,
    ),
    *[
        Claim(
            "FedFM", f"FedFM above {other}, CIFAR-10 missing-1, simple-cnn with BatchNorm",
            f"Table III: on average over missing 1, 2, 3, 5, 7 classes FedFM is {gap} points "
            f"above {other}",
            "fedfm-cifar10", "bn-missing1", "fedfm", [other], differs=FM_DIFF,
        )
        for other, gap in (("fedavg", "+5.53"), ("scaffold", "+2.28"))
    ],
    Claim(
        "FedFM", "SCAFFOLD above FedAvg, CIFAR-10 NIID-1, simple-cnn with BatchNorm",
        "SCAFFOLD second best at 69.91 % (Table II)",
        "fedfm-cifar10", "bn", "scaffold", ["fedavg"], differs=FM_DIFF,
    ),
    *[
        Claim(
            "FedFM", f"FM as a plug-in: {base}+FM above {base}, simple-cnn with BatchNorm",
            "FM added to FedAvg, FedProx, FedNova and MOON gives +4.63 points on average "
            "(Fig. 8a)",
            "fedfm-cifar10", "bn", method, [base], differs=FM_DIFF,
        )
        for base, method in (
            ("fedavg", "fedfm"), ("fedprox", "fedprox-fm"), ("fednova", "fednova-fm"),
            ("moon", "moon-fm"),
        )
    ],
    *[
        Claim(
            "FedFM", f"FedFM best of the Table II baselines, CIFAR-10 {task}, simple-cnn {label}",
            said, "fedfm-cifar10", setting, "fedfm", FM_BASELINES, kind="best",
            differs=FM_DIFF,
        )
        for setting, task, label, said in (
            ("bn", "NIID-1", "with BatchNorm", TABLE_II_BEST),
            ("plain", "NIID-1", "without normalisation", TABLE_II_BEST),
            ("bn-niid2", "NIID-2", "with BatchNorm", TABLE_II_BEST),
            ("bn-missing1", "missing-1", "with BatchNorm", "FedFM 'consistently outperforms' "
             "the other methods at missing 1, 2, 3, 5 and 7 classes (Table III)"),
        )
    ],
    Claim(
        "FedFM", "contrastive-guiding loss above the l2 loss, simple-cnn with BatchNorm",
        "the CG loss is chosen over l2 (the 'FedFM l2' ablation; its value is not recovered)",
        "fedfm-cifar10", "bn", "fedfm", ["fedfm-l2"], differs=FM_DIFF,
    ),
    Claim(
        "FedFM", "weighted and uniform anchors within 1 point, simple-cnn with BatchNorm",
        "uniform anchor aggregation is 0.02 points below weighted (Table VI)",
        "fedfm-cifar10", "bn", "fedfm", ["fedfm-uniform"], kind="similar", differs=FM_DIFF,
    ),
    *[
        Claim(
            "FedFM", f"FedFM-Lite a = {a} best of the Table II baselines, simple-cnn with "
            "BatchNorm",
            "for a in {1, 2, 5} FedFM-Lite beats all compared methods (Section 2.5 claims)",
            "fedfm-cifar10", "bn", f"fedfm-lite-a{a}", FM_BASELINES, kind="best",
            differs=FM_DIFF,
        )
        for a in (1, 2, 5)
    ],
    *[
        Claim(
            "FedFM", f"FedFM-Lite a = 5 above {other}, simple-cnn with BatchNorm",
            f"a = 5 beats {other} by {gap} points with {less} less communication",
            "fedfm-cifar10", "bn", "fedfm-lite-a5", [other], differs=FM_DIFF,
        )
        for other, gap, less in (("feddyn", "2.34", "5x"), ("scaffold", "0.75", "10x"))
    ],
    *[
        Claim(
            "FedFM", f"FedFM (lam {lam}) above FedAvg with a later launch: 30 rounds, T_s 10, "
            "simple-cnn with BatchNorm",
            "about 72 % vs about 66 % (the official code's README [CODE])",
            "fedfm-longer", "", method, ["fedavg"],
            differs=FM_DIFF,
        )
        for lam, method in (("50", "fedfm"), ("5", "fedfm-lam5"))
    ],
    *[
        Claim(
            "FedFM (remedy)", f"FedFM with lam warm-up above FedAvg, simple-cnn {label}",
            "not in the paper: does the remedy keep FedFM's gain?",
            "fedfm-cifar10", setting, "fedfm-warmup", ["fedavg"], differs=FM_DIFF,
        )
        for setting, label in REMEDY_SETTINGS
    ],
    *[
        Claim(
            "FedFM (remedy)", f"{text}, simple-cnn {label}",
            "not in the paper: does clipping keep FedFM's launch, and does FedFM then gain?",
            "fedfm-cifar10", setting, "fedfm-clip10", [other], differs=FM_DIFF,
        )
        for setting, label in REMEDY_SETTINGS
        for other, text in (
            ("fedfm", "FedFM with grad-clip 10 above FedFM"),
            ("fedavg", "FedFM with grad-clip 10 above FedAvg"),
            ("fedavg-clip10", "FedFM with grad-clip 10 above FedAvg with grad-clip 10"),
        )
    ],
    *[
        Claim(
            "FedFM (remedy)", f"{text}, simple-cnn {label}",
            "not in the paper: do anchors before the last ReLU keep FedFM's launch, and does "
            "FedFM then gain?",
            "fedfm-cifar10", setting, "fedfm-prerelu", [other], differs=FM_DIFF,
        )
        for setting, label in REMEDY_SETTINGS
        for other, text in (
            ("fedfm", "FedFM matching before the last ReLU above FedFM"),
            ("fedavg", "FedFM matching before the last ReLU above FedAvg"),
        )
    ],
    *[
        Claim(
            "FedACD", f"FedACD above FedAvg, CIFAR-10, Dirichlet {beta} (uniform test set)",
            "FedACD best in all settings (Table 1, qualitative; no number recovered)",
            "fedacd-cifar10", f"beta{beta}", "fedacd", ["fedavg"], differs=ACD_DIFF,
        )
        for beta in ("0.3", "0.1", "0.05")
    ],
    *[
        Claim(
            "FedACD", f"FedACD best of FedAvg and the Table 1 baselines, Dirichlet {beta} "
            f"({label})",
            f"FedACD best in all settings ({table}, qualitative; no number recovered)",
            "fedacd-cifar10", f"beta{beta}", "fedacd", ACD_BASELINES, kind="best",
            metric=metric, differs=ACD_DIFF,
        )
        for beta in ("0.1", "0.3", "0.05")
        for label, table, metric in (
            ("uniform test set", "Table 1", "accuracy"),
            ("clients' label distributions", "Table 2", "client_dist_accuracy"),
        )
    ],
    Claim(
        "FedACD", "FedACD above FedAvg on the clients' label distributions, Dirichlet 0.1",
        "FedACD best on test sets matched to the clients' distributions (Table 2, qualitative)",
        "fedacd-cifar10", "beta0.1", "fedacd", ["fedavg"],
        metric="client_dist_accuracy", differs=ACD_DIFF,
    ),
    Claim(
        "FedACD", "FedACD's local models below FedAvg's in risk over the clients' "
        "distributions, Dirichlet 0.1 (risk in %; ahead means lower)",
        "FedACD's local models have the lowest risk (Table 3, qualitative)",
        "fedacd-cifar10", "beta0.1", "fedacd", ["fedavg"], metric="local_risk",
        lower_is_better=True, differs=ACD_DIFF,
    ),
    *[
        claim
        for beta in ("0.1", "0.3", "0.05")
        for claim in (
            Claim(
                "FedACD", f"FedACD without mixup best of FedAvg and the Table 1 baselines "
                f"(none uses mixup), Dirichlet {beta}",
                "FedACD without Input Mixup outperforms the baselines without it under all "
                "settings (Table 5, qualitative)",
                "fedacd-cifar10", f"beta{beta}", "fedacd-nomixup", ACD_BASELINES, kind="best",
                differs=[
                    *ACD_DIFF,
                    "Table 5 compares a subset of the Table 1 baselines that the text does not "
                    "name; here all nine",
                ],
            ),
            Claim(
                "FedACD", f"FedACD with mixup above without, Dirichlet {beta}",
                "input mixup helps FedACD (Table 5, qualitative)",
                "fedacd-cifar10", f"beta{beta}", "fedacd", ["fedacd-nomixup"],
                differs=ACD_DIFF,
            ),
            Claim(
                "FedACD", f"FedACD above FedACD_base (uniform weights), Dirichlet {beta}",
                "adaptability-weighted aggregation helps (Table 8, qualitative)",
                "fedacd-cifar10", f"beta{beta}", "fedacd", ["fedacd-base"], differs=ACD_DIFF,
            ),
        )
    ],
]  # fmt: skip


# --------------------------------------------------------------------------- reading runs


@dataclass
class Grid:
    name: str
    manifest: dict[str, Any]
    records: list[RunRecord]

    @property
    def last(self) -> int:
        return int(self.manifest.get("last", 3))

    @property
    def seeds(self) -> list[int]:
        return [int(s) for s in self.manifest.get("seeds", [])]

    def find(self, setting: str, method: str, seed: int) -> RunRecord | None:
        for r in self.records:
            if (r.setting, r.method, r.seed) == (setting, method, seed):
                return r
        return None

    def log(self, setting: str, method: str, seed: int) -> str:
        """The compare log of a failed run ('' if none). A run that failed leaves only its
        log in a fresh clone: its `.incomplete` folder is not committed."""
        path = compare.log_of(RUNS / self.name / "logs", compare.folder_of(setting, method, seed))
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def read_grids() -> dict[str, Grid]:
    grids = {}
    for name in GRIDS:
        root = RUNS / name
        manifest_path = root / "compare.json"
        if not manifest_path.exists():
            continue
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        grids[name] = Grid(name, manifest, find_runs(root))
    return grids


def claim_records(claim: Claim, grid: Grid | None) -> list[RunRecord]:
    """The finished runs of the claim's methods in its setting, on the grid's seeds."""
    if grid is None:
        return []
    methods = {claim.method, *claim.against}
    return [
        r for r in grid.records
        if r.finished and r.setting == claim.setting and r.method in methods
        and r.seed in grid.seeds
    ]  # fmt: skip


DIVERGED = re.compile(r"round (\d+): client (\d+) diverged")


def run_state(grid: Grid, setting: str, method: str, seed: int) -> tuple[str, RunRecord | None]:
    """('done' | 'diverged (NaN) in round r' | 'unfinished, r of R' | 'not run', the finished
    run's record or None)."""
    record = grid.find(setting, method, seed)
    if record is not None and record.finished:
        return "done", record
    found = DIVERGED.search(grid.log(setting, method, seed))
    if found:
        return f"diverged (NaN) in round {found.group(1)}", None
    if record is None:
        return "not run", None
    return f"unfinished, {len(record.metrics)} of {record.rounds_planned} rounds", None


def status(grid: Grid, setting: str, method: str, seed: int) -> tuple[str, float | None]:
    """The run's state (as ``run_state``) and its last-N accuracy when finished."""
    state, record = run_state(grid, setting, method, seed)
    return state, None if record is None else last_mean(record, "accuracy", grid.last)


def last_mean(record: RunRecord, key: str, last: int) -> float | None:
    values = [v for _, v in record.series(key)][-last:]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return 100 * sum(values) / len(values)


# --------------------------------------------------------------------------- verdicts


def fmt(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def mean_std(xs: list[float], sign: bool = False) -> str:
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return fmt(m, sign)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{fmt(m, sign)} ± {sd:.2f}"


@dataclass
class Outcome:
    ours: str
    theirs: str
    difference: str
    verdict: str
    seeds: str
    open_seeds: tuple[int, ...] = ()  # seeds that no finished or diverged run has decided yet
    margin: str = "-"  # the noise margin of the difference (Noise.text)
    origin: str = "-"  # the machines and commits its runs came from (RunsOrigin.text)


# --------------------------------------------------------------------------- noise


@dataclass
class RerunSpread:
    """What rerun_spread.py measured (rerun_spread.json): per kind of difference between
    two runs of one configuration, seed and partition, and per metric, the largest gap of
    their mean over the last k rounds, per k, in points."""

    kinds: dict[str, dict[str, Any]]

    def measured(self, kind: str, metric: str, last: int) -> float | None:
        found = ((self.kinds.get(kind) or {}).get(metric) or {}).get("window", {})
        value = found.get(str(last))
        return float(value) if value is not None else None

    def at(self, kind: str, metric: str, last: int) -> tuple[float, str, bool] | None:
        """The spread a claim whose runs differ by ``kind`` admits, the kind measured that
        gave it, and whether ``kind`` itself was measured: the largest of its kind and the
        narrower ones. Where its own kind was not measured, the broadest kind measured
        stands in (the row says so)."""
        known = [k for k in KINDS if self.measured(k, metric, last) is not None]
        admitted = [k for k in known if KINDS.index(k) <= KINDS.index(kind)]
        own = kind in admitted
        if not own:
            admitted = known[-1:]
        if not admitted:
            return None
        # On a tie the broadest kind names it (the claim's own where it was measured).
        worst = max(reversed(admitted), key=lambda k: self.measured(k, metric, last) or 0.0)
        return self.measured(worst, metric, last) or 0.0, worst, own


def read_spread(path: Path | None = None) -> RerunSpread | None:
    """rerun_spread.json's spread (None where the file is not there yet)."""
    record = read_json(path or SPREAD_FILE)
    return RerunSpread(record.get("spread") or {}) if record else None


@dataclass
class Noise:
    """The noise margin of a lead (the mean paired difference, in points): the larger of
    the rerun spread that the claim's runs admit and the half-width of the Student-t
    interval (LEVEL) of the mean over its seeds."""

    lead: float | None
    # (spread, the kind measured that gave it, whether own_kind itself was measured)
    rerun: tuple[float, str, bool] | None
    own_kind: str  # the kind of difference among the claim's runs
    t_half: float | None  # None with fewer than two seeds

    @property
    def margin(self) -> float | None:
        parts = [x for x in (self.rerun[0] if self.rerun else None, self.t_half) if x is not None]
        return max(parts) if parts else None

    @property
    def within(self) -> bool:
        return self.lead is not None and self.margin is not None and abs(self.lead) <= self.margin

    def text(self, metric: str) -> str:
        if self.margin is None:
            return f"none (one seed; no rerun spread measured for {metric})"
        if self.rerun is None:
            rerun = f"rerun spread not measured for {metric}"
        else:
            spread, kind, own = self.rerun
            rerun = f"rerun {spread:.2f} [{kind}" + (
                "]" if own else f", standing in for {self.own_kind}, not measured]"
            )
        t = "t: one seed" if self.t_half is None else f"t {self.t_half:.2f}"
        return f"±{self.margin:.2f} ({rerun}; {t})"


def noise_of(
    diffs: list[float], kind: str, metric: str, last: int, spread: RerunSpread | None
) -> Noise:
    n = len(diffs)
    lead = sum(diffs) / n if n else None
    t_half = None
    if n >= 2:
        sd = math.sqrt(sum((d - lead) ** 2 for d in diffs) / (n - 1))
        t_half = t_quantile(LEVEL, n - 1) * sd / math.sqrt(n)
    rerun = spread.at(kind, metric, last) if spread is not None else None
    return Noise(lead, rerun, kind, t_half)


@dataclass
class RunsOrigin:
    kind: str  # rerun_spread's kind of difference among the runs: SAME, COMMIT or MACHINE
    text: str


def seeds_of(labels: list[tuple[str, int]]) -> str:
    """'fedfm s0/1/2, scaffold s0' for (method, seed) pairs."""
    by: dict[str, list[int]] = {}
    for method, seed in labels:
        if seed not in by.setdefault(method, []):
            by[method].append(seed)
    return ", ".join(f"{m} s{'/'.join(str(s) for s in sorted(ss))}" for m, ss in by.items())


def runs_origin(records: list[RunRecord]) -> RunsOrigin:
    """Whether the runs came from one machine (recorded CPU model) and one clean commit,
    and if not which machines and commits computed which of them, from their processes.jsonl
    (a resumed run may be listed under two)."""
    facts: dict[str, dict[str, list[tuple[str, int]]]] = {
        k: {} for k in ("cpu", "commit", "torch", "threads")
    }
    if not records:
        return RunsOrigin(SAME, "-")
    for rec in records:
        found = rerun_spread.origin(rec)
        for key in facts:
            for value in found[key] or ["not recorded"]:
                facts[key].setdefault(value, []).append((rec.method, rec.seed))
    cpus, commits = facts["cpu"], facts["commit"]
    unsure = "not recorded" in cpus or "not recorded" in commits
    if unsure or len(cpus) > 1 or len(facts["torch"]) > 1 or len(facts["threads"]) > 1:
        kind = MACHINE
    elif len(commits) > 1 or any(c.endswith("(modified)") for c in commits):
        kind = rerun_spread.COMMIT
    else:
        kind = SAME
    if kind == SAME:
        return RunsOrigin(kind, f"one machine and one clean commit ({next(iter(cpus))}; "
                                f"{next(iter(commits))})")  # fmt: skip
    parts = []
    for key, what in (("cpu", "machines"), ("commit", "commits"), ("torch", "torch versions"),
                      ("threads", "thread counts")):  # fmt: skip
        found = facts[key]
        if len(found) > 1 or (key == "commit" and kind != MACHINE):
            label = what if len(found) > 1 else what[:-1]
            if key == "commit" and len(found) > 1 and any("(modified)" in c for c in found):
                label += " (a modified tree counted apart)"
            parts.append(f"{len(found)} {label}: " + "; ".join(
                f"[{value}] {seeds_of(runs)}" for value, runs in found.items()
            ))  # fmt: skip
        elif key in ("cpu", "commit"):
            parts.append(f"1 {what[:-1]} ({next(iter(found))})")
    return RunsOrigin(kind, "not one machine and one clean commit: " + "; ".join(parts))


def judge(claim: Claim, grid: Grid | None, spread: RerunSpread | None = None) -> Outcome:
    """The claim's numbers and verdict; ``spread``: the measured rerun spread (None: not
    measured, the noise margin is then the seeds' t-interval alone)."""
    if grid is None:
        return Outcome("-", "-", "-", "pending: not run yet", "0")
    methods = [claim.method, *claim.against]
    show = -1.0 if claim.lower_is_better else 1.0  # values are negated inside: undo for display
    per_seed: dict[int, dict[str, float]] = {}
    diverged: list[str] = []
    # A seed where a run diverged has no accuracy to average, but it still decides the seed:
    # lost when the claimed method diverged, won when only a method it is compared with did.
    lost_by_divergence: set[int] = set()
    won_by_divergence: set[int] = set()
    # A "best of" claim loses a seed as soon as one finished method is ahead of the claimed
    # one: the runs still missing can only add rivals, never take that one away.
    lost_early: dict[int, str] = {}
    used: dict[int, list[RunRecord]] = defaultdict(list)  # the finished runs of each seed
    for seed in grid.seeds:
        values = {}
        states = {}
        for m in methods:
            states[m], rec = run_state(grid, claim.setting, m, seed)
            if rec is not None:
                used[seed].append(rec)
            if states[m].startswith("diverged"):
                diverged.append(f"{m} seed {seed}: {states[m]}")
            v = None if rec is None else last_mean(rec, claim.metric, grid.last)
            if v is not None:
                values[m] = -v if claim.lower_is_better else v
        if states[claim.method].startswith("diverged"):
            lost_by_divergence.add(seed)
        if len(values) == len(methods):
            per_seed[seed] = values
        elif (
            claim.method in values
            and all(m in values or states[m].startswith("diverged") for m in methods)
            and all(values[claim.method] > x for m, x in values.items() if m != claim.method)
        ):
            won_by_divergence.add(seed)
        elif claim.kind == "best" and claim.method in values:
            rival = max((m for m in values if m != claim.method), key=values.get, default=None)
            if rival is not None and values[rival] > values[claim.method]:
                lost_early[seed] = (
                    f"seed {seed} lost: {rival} {show * values[rival]:.2f} vs "
                    f"{claim.method} {show * values[claim.method]:.2f}, decided before "
                    "every run finished"
                )
    if claim.kind == "similar":  # a diverged run is never alike the other
        lost_by_divergence |= won_by_divergence
        won_by_divergence = set()
    n, planned = len(per_seed), len(grid.seeds)
    decided_seeds = {*per_seed, *lost_by_divergence, *won_by_divergence, *lost_early}
    decided = len(decided_seeds)
    by_divergence = len(lost_by_divergence) + len(won_by_divergence)
    seeds = f"{n} of {planned}" + "".join(
        f" (+{k} {why})"
        for k, why in (
            (by_divergence, "decided by a divergence"),
            (len(lost_early), "lost before all their runs finished"),
        )
        if k
    )
    ours_v = [v[claim.method] for v in per_seed.values()]
    if claim.kind in ("above", "similar"):
        other = claim.against[0]
        theirs_v = [v[other] for v in per_seed.values()]
        diffs = [a - b for a, b in zip(ours_v, theirs_v, strict=True)]
        wins = sum(d > 0 for d in diffs)
        theirs = f"{other}: {mean_std([show * x for x in theirs_v])}"
    else:
        theirs_v, diffs, wins = [], [], 0
        for v in per_seed.values():
            best_other = max(v[m] for m in claim.against)
            diffs.append(v[claim.method] - best_other)
            wins += v[claim.method] > best_other
        means = {m: sum(v[m] for v in per_seed.values()) / n for m in claim.against if n}
        theirs = (
            ", ".join(
                f"{m}: {show * x:.2f}" for m, x in sorted(means.items(), key=lambda kv: -kv[1])
            )
            if means
            else "-"
        )
    wins += len(won_by_divergence)
    origin = runs_origin([r for s in sorted(decided_seeds) for r in used[s]])
    noise = noise_of(diffs, origin.kind, claim.metric, grid.last, spread)
    # A seed decided by a divergence, or lost before its runs finished, has no paired
    # number: the noise margin cannot speak for it, and the seeds' outcomes decide.
    within = claim.kind != "similar" and n == decided and noise.within
    if decided == 0:
        verdict = "pending: no seed has all its runs finished"
    else:
        # The mean is over the seeds with numbers; where no seed has numbers (every seed
        # decided by a divergence), the seeds' outcomes alone decide.
        ahead = sum(diffs) / n > 0 if n else wins > decided / 2
        if claim.kind == "similar":
            mean_diff = sum(diffs) / n if n else math.inf
            close = abs(mean_diff) <= SIMILAR_POINTS and not lost_by_divergence
            verdict = "reproduced" if close else "not reproduced"
            if n:
                verdict += f" (mean difference {mean_diff:+.2f}, limit ±{SIMILAR_POINTS:g})"
        elif within:
            verdict = "within noise"
        elif ahead and wins == decided:
            verdict = "reproduced"
        elif ahead or wins > 0:
            verdict = "partly"
        else:
            verdict = "not reproduced"
        if within:
            # shown as measured (a risk not negated), as the difference column is
            verdict += (
                f" (lead {show * (noise.lead or 0.0):+.2f} within ±{noise.margin or 0.0:.2f}; "
                f"ahead on {wins} of {decided} seeds)"
            )
        elif claim.kind != "similar":
            verdict += f" (ahead on {wins} of {decided} seeds)"
        if decided < planned:
            verdict += f"; {planned - decided} seed(s) pending"
        if diverged:
            verdict += "; " + "; ".join(diverged)
        if lost_early:
            verdict += "; " + "; ".join(lost_early[s] for s in sorted(lost_early))
    return Outcome(
        f"{claim.method}: {mean_std([show * x for x in ours_v])}",
        theirs,
        mean_std([show * d for d in diffs], sign=True),
        verdict,
        seeds,
        tuple(s for s in grid.seeds if s not in decided_seeds),
        noise.text(claim.metric) if n else "-",
        origin.text,
    )


# --------------------------------------------------------------------------- sections


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


def scale_section(grids: dict[str, Grid]) -> list[str]:
    rows = []
    for name, (file, paper) in GRIDS.items():
        grid = grids.get(name)
        base = grid.manifest.get("base", {}) if grid else {}
        settings = grid.manifest.get("settings", {}) if grid else {}
        models = sorted(
            {
                f"{s.get('model', base.get('model', '-'))} "
                f"{json.dumps(s.get('model_options', base.get('model_options', {})))}"
                for s in settings.values() or [base]
            }
        )
        model = " / ".join(m.removesuffix(" {}") for m in models)
        clients = f"{base.get('num_clients', '-')}, " + (
            f"{base['clients_per_round']} per round"
            if "clients_per_round" in base
            else f"participation {base.get('participation', '-')}"
        )
        rows.append(
            [
                f"`{file}`",
                f"{model}; {base.get('rounds', '-')} rounds of {base.get('local_epochs', '-')} "
                f"local epochs; {clients}; {base.get('dataset', '-')}",
                "; ".join(f"{k}: {v}" for k, v in paper.items()),
                still_rising(grid) if grid else "-",
            ]
        )
    return table(
        ["grid", "here (from its compare.json)", "the paper (ALGORITHMS.md)",
         "the reference method's accuracy over its last 3 rounds"],
        rows,
    )  # fmt: skip


def still_rising(grid: Grid) -> str:
    """How far from converged the scaled-down runs stop: the reference method's accuracy
    gain over its last 3 rounds, per setting (mean over finished seeds)."""
    ref = str(grid.manifest.get("reference") or "")
    parts = []
    for setting in grid.manifest.get("settings", {}):
        gains = []
        for seed in grid.seeds:
            rec = grid.find(setting, ref, seed)
            acc = [a for _, a in rec.series("accuracy")] if rec is not None and rec.finished else []
            if len(acc) >= 4 and all(math.isfinite(a) for a in acc[-4:]):
                gains.append(100 * (acc[-1] - acc[-4]))
        if gains:
            label = f"{setting}: " if setting else ""
            parts.append(f"{label}{ref} {mean_std(gains, sign=True)} points")
    return "; ".join(parts) or "-"


def stability_section(grids: dict[str, Grid]) -> list[str]:
    grid = grids.get("fedfm-stability")
    if grid is None:
        return ["Not run yet (`fedskew compare -c reproduction/fedfm-stability.toml`)."]
    methods = list(grid.manifest.get("methods", {}))
    rows = []
    for setting in grid.manifest.get("settings", {}):
        cells = [setting]
        for m in methods:
            state, acc = status(grid, setting, m, grid.seeds[0])
            cells.append(fmt(acc) if state == "done" else state)
        rows.append(cells)
    lines = [
        f"Accuracy (%, mean of the last {grid.last} rounds) or what stopped the run; seed "
        f"{grid.seeds[0]}, {grid.manifest['base'].get('rounds')} rounds, T_s = "
        f"{launch_rounds(grid.records) or 'not recorded'} (0-based; from the runs).",
        "",
        *table(["setting (model, lr)", *methods], rows),
    ]
    return lines


def launch_rounds(records: list[RunRecord]) -> str:
    """The launching rounds (start_round) the runs resolved, distinct."""
    return distinct(
        start_round(r.config, r.resolved.get("algorithm_params") or {}) for r in records
    )


MEASURES = (
    ("accuracy", "uniform test set (%)", 100.0),
    ("client_dist_accuracy", "clients' distributions (%)", 100.0),
    ("local_risk", "risk of the local models", 1.0),
)


def measures_section(grid: Grid | None) -> list[str]:
    """FedACD's three measures per setting and method: the last round's values (local_risk
    is measured at the last round only), mean ± std over finished seeds."""
    if grid is None:
        return ["Not run yet."]
    rows = []
    for setting in grid.manifest.get("settings", {}):
        for method in grid.manifest.get("methods", {}):
            recs = [grid.find(setting, method, s) for s in grid.seeds]
            done = [r for r in recs if r is not None and r.finished]
            if not done:
                continue
            cells = [setting, method, f"{len(done)} of {len(grid.seeds)}"]
            for key, _, scale in MEASURES:
                vals = [v[-1][1] * scale for v in (r.series(key) for r in done) if v]
                cells.append(mean_std(vals) if vals else "not measured")
            rows.append(cells)
    if not rows:
        return ["No finished run yet."]
    lines = table(["setting", "method", "seeds", *(label for _, label, _ in MEASURES)], rows)
    unmeasured = sorted({r[1] for r in rows if "not measured" in r[3:]})
    if unmeasured:
        lines += [
            "",
            f"Not measured ({', '.join(unmeasured)}): a local model's risk is scored on the "
            "model a client uploads, and these methods' replies hold no whole local model "
            "(the rule and the methods it skips: the docstring of "
            "`src/fedskew/runs/measurements.py`).",
        ]
    return lines


def per_class_section(grids: dict[str, Grid]) -> list[str]:
    """Per grid and setting: the mean accuracy over the minority and the majority half of
    the classes, as `fedskew report` splits them, and which ranking each seed used."""
    datasets: dict[str, Any] = {}

    def load(cfg):  # each dataset once, from local files only (cfg.download is off)
        key = repr((cfg.dataset, cfg.data_dir, cfg.num_clients, cfg.seed))
        if key not in datasets:
            datasets[key] = load_experiment_data(cfg)
        return datasets[key]

    counts = PartitionCounts(load)
    lines: list[str] = []
    for name, grid in grids.items():
        settings: dict[str, list[RunRecord]] = defaultdict(list)
        for rec in grid.records:
            settings[rec.setting].append(rec)
        rows, header = [], []
        rankings = defaultdict(list)  # ranking line -> the settings that share it
        for setting, recs in settings.items():
            split = minority_majority(recs, grid.last, counts, class_names_of(recs))
            for line in split.lines:
                rankings[line].append(setting)
            if split.table is not None:
                rows += [[setting or "-", *row] for row in split.table.rows]
                header = ["setting", *split.table.header]
        lines += [f"### {name}", ""]
        lines += [
            f"- {', '.join(s for s in settings_of if s) or 'all runs'}: {line}"
            for line, settings_of in rankings.items()
        ]
        if rows:
            lines += ["", *table(header, rows)]
        lines.append("")
    return lines[:-1]


def tuned_study() -> Path:
    """The tuning study's folder (`fedskew tune -c reproduction/fedfm-tuned.toml`)."""
    return RUNS / "fedfm-tuned"


def tuning_section() -> list[str]:
    """The tuning study's budget, search space and best values, from its tune.json (written
    by `fedskew tune`, or `fedskew tune ... --results-only` while it runs)."""
    path = tuned_study() / "tune.json"
    if not path.is_file():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return ["Not started: `fedskew tune -c reproduction/fedfm-tuned.toml` has written no "
                f"`{shown}` yet."]  # fmt: skip
    record = json.loads(path.read_text(encoding="utf-8"))
    budget = record["trials_per_method"]
    lines = [
        f"`reproduction/fedfm-tuned.toml`: {budget} trials per method (the same budget for "
        f"each), tuning seeds {record['tuning_seeds']}, evaluation seeds "
        f"{record['evaluation_seeds']}; objective: {record['objective']}"
        f"{''.join(f'; {t}' for t in validation_terms(record))}; sampler "
        f"{record['sampler']} (seed {record['sampler_seed']}), pruner {record['pruner']}"
        f"{pruner_terms(record)}. "
        "The tuned values are then run on the evaluation seeds (`fedskew compare -c "
        'reproduction/runs/fedfm-tuned/tuned.json`); the claim row above with "both tuned" '
        "is judged on those runs.",
        "",
    ]
    rows = []
    unfinished = []
    stops = []
    for method, res in record["results"].items():
        rounds = Counter(rnd for _seed, rnd in res.get("pruned_at", {}).values())
        if rounds:
            stops.append(f"{method}: " + ", ".join(
                f"{n} after round {r}" for r, n in sorted(rounds.items())
            ))  # fmt: skip
        counts = res["trials"]
        used = sum(counts.get(s, 0) for s in ("complete", "pruned", "fail"))
        if used < budget:
            unfinished.append(f"{method} {used} of {budget}")
        space = "; ".join(
            f"{k} {kind} {values}"
            for k, spec in record["search_space"][method].items()
            for kind, values in spec.items()
        )
        best = res["best_params"] or {}
        rows.append([
            method, space,
            ", ".join(f"{k} {n}" for k, n in sorted(counts.items())),
            fmt(res["best_value"]),
            ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in best.items()) or "-",
        ])  # fmt: skip
    if unfinished:
        used = ", ".join(unfinished)
        lines += [
            f"**In progress** (trials used: {used}): the best values below may still change, "
            "and the tuned comparison waits for the study.",
            "",
        ]
    lines += table(["method", "search space", "trials", "best objective (%)", "best values"], rows)
    if stops:
        lines += [
            "",
            "Where the pruned trials stopped (from tune.json): " + "; ".join(stops) + ". "
            "A trial stopped after its first rounds was judged on a curve that says little "
            "about round 12; the study's warm-up (`pruner_warmup`) is recorded above.",
        ]
    return lines


def pruner_terms(record: dict) -> str:
    """The pruner's warm-up and start-up as tune.json records them ("" before they were)."""
    if record.get("pruner") == "none" or "pruner_warmup" not in record:
        return ""
    return (f" (warm-up {record['pruner_warmup']} rounds, start-up "
            f"{record['pruner_startup']} trials)")  # fmt: skip


def launch_section(grids: dict[str, Grid]) -> list[str]:
    """What the FedFM runs looked like at their launching round: the accuracy before it and
    after it, and how far apart the global anchors were (runs that log it)."""
    rows = []
    for name in ("fedfm-stability", "fedfm-longer", "fedfm-cifar10"):
        grid = grids.get(name)
        if grid is None:
            continue
        for rec in grid.records:
            rows_m = rec.metrics
            first = next((i for i, r in enumerate(rows_m) if r.get("fm_active") == 1.0), None)
            if first is None or "fm_cg_floor" not in rows_m[first]:
                continue
            before = rows_m[first - 1]["accuracy"] if first > 0 else float("nan")
            after = rows_m[first].get("accuracy", float("nan"))
            state, _ = status(grid, rec.setting, rec.method, rec.seed)
            rows.append(
                [f"{name}/{rec.setting + '/' if rec.setting else ''}{rec.method}-s{rec.seed}",
                 str(rows_m[first]["round"]), fmt(100 * before), fmt(100 * after),
                 f"{rows_m[first]['fm_anchor_cos_max']:.3f}",
                 f"{rows_m[first]['fm_cg_floor']:.3f}", state]
            )  # fmt: skip
    if not rows:
        return ["No FedFM run with the anchor metrics yet."]
    return table(
        ["run", "launching round", "accuracy before (%)", "after (%)",
         "largest cosine between two anchors", "CG floor", "run"],
        rows,
    )  # fmt: skip


def provenance_section(grids: dict[str, Grid]) -> list[str]:
    rows = []
    for name, grid in grids.items():
        spans: dict[tuple[str, str, str, str], list[str]] = defaultdict(list)
        for rec in grid.records:
            p = provenance(rec)
            key = (p["torch"], p["git commit"], p["data source"], p["device"])
            where = machine_spans(rec)
            label = f"{rec.setting + '/' if rec.setting else ''}{rec.method}-s{rec.seed}"
            spans[key].append(f"{label} ({where})")
        for (torch, git, source, device), runs in spans.items():
            rows.append([name, "; ".join(runs), device, torch, git, source])
    return table(
        ["grid", "runs (which machine computed which rounds)", "device", "torch", "git commit",
         "data"],
        rows,
    )  # fmt: skip


def pending_runs(grid: Grid) -> list[tuple[str, str, int, str, float | None]]:
    """(setting, method, seed, seed label, estimated seconds) of each planned run that has not
    finished; a run that diverged is done (its verdict counts it). The estimate is the median
    time of the finished runs of the same setting and method, else of the setting (same
    model and data), else None; the part of an unfinished run that is done is not taken
    off."""
    out = []
    for run in grid.manifest.get("runs", []):
        setting, method, seed = run.get("setting", ""), run["method"], int(run["seed"])
        state, _ = run_state(grid, setting, method, seed)
        if state == "done" or state.startswith("diverged"):
            continue
        estimate = estimated_seconds(grid.records, setting, method)
        label = f"s{seed}" + ("" if state == "not run" else f" {state}")
        out.append((setting, method, seed, label, estimate))
    return out


def needed_by_claims(name: str) -> set[tuple[str, str]]:
    return {(c.setting, m) for c in CLAIMS if c.grid == name for m in (c.method, *c.against)}


def needed_by_verdicts(
    name: str, outcomes: list[tuple[Claim, Outcome]]
) -> set[tuple[str, str, int]]:
    """The (setting, method, seed) runs whose claims still wait for that seed; a claim's
    other runs only fill its means."""
    return {
        (c.setting, m, seed)
        for c, o in outcomes
        if c.grid == name
        for seed in o.open_seeds
        for m in (c.method, *c.against)
    }


def pending_rows(name: str, runs: list[tuple[str, str, int, str, float | None]], what: str):
    if not runs:
        return []
    known = [e for *_, e in runs if e is not None]
    hours = f"about {sum(known) / 3600:.1f}" if known else "unknown"
    if len(known) < len(runs):
        hours += f" (for {len(known)} of them)"
    seeds: dict[tuple[str, str], list[str]] = defaultdict(list)
    for setting, method, _, label, _ in runs:
        seeds[(setting, method)].append(label)
    listed = "; ".join(
        f"{setting + '/' if setting else ''}{method} ({', '.join(labels)})"
        for (setting, method), labels in seeds.items()
    )
    return [[name, what, str(len(runs)), hours, listed]]


def pending_section(grids: dict[str, Grid], outcomes: list[tuple[Claim, Outcome]]) -> list[str]:
    rows = []
    for name, grid in grids.items():
        runs = pending_runs(grid)
        needed, verdicts = needed_by_claims(name), needed_by_verdicts(name, outcomes)
        groups = {"a verdict": [], "a claim's means only": [], "no claim": []}
        for r in runs:
            if r[:3] in verdicts:
                groups["a verdict"].append(r)
            elif r[:2] in needed:
                groups["a claim's means only"].append(r)
            else:
                groups["no claim"].append(r)
        for what, group in groups.items():
            rows += pending_rows(name, group, what)
    if not rows:
        return ["Every planned run has finished (or diverged)."]
    return [
        "Runs that each grid's compare.json plans and that have not finished. Those a "
        "verdict needs leave a claim's row pending or resting on fewer seeds; those of a "
        "claim's means only belong to seeds its verdict has already decided (a 'best of' "
        "claim lost to a finished rival) and fill in its means; the others complete the "
        "grid's tables (comparison.md) but decide no verdict. `fedskew compare -c "
        "reproduction/<grid>.toml --only SETTING/METHOD-sSEED ...` runs some of them, without "
        "`--only` all (finished runs are skipped). CPU hours: per run, the median time of "
        "the grid's finished runs of the same method and setting (of the setting where the "
        "method has none; unknown where the setting has none), summed; one run per core "
        "as they ran here (the provenance table names the machines). An unfinished folder "
        "is not committed: its rounds are on the machine that ran them.",
        "",
        *table(["grid", "needed by", "runs", "CPU hours", "setting/method (seeds)"], rows),
    ]


VERDICTS = ("reproduced", "partly", "within noise", "not reproduced", "pending")


def summary_section(outcomes: list[tuple[Claim, Outcome]]) -> list[str]:
    """How many claims of each paper got each verdict, counted from the table below."""
    counts: dict[str, dict[str, int]] = {}
    for claim, o in outcomes:
        verdict = next(v for v in VERDICTS if o.verdict.startswith(v))
        row = counts.setdefault(claim.paper, dict.fromkeys(VERDICTS, 0))
        row[verdict] += 1
    return [
        "Claims per paper by verdict (counted from the table below; a verdict on fewer "
        "seeds than planned says so in its row):",
        "",
        *table(
            ["paper", *VERDICTS],
            [[paper, *(str(n) for n in row.values())] for paper, row in counts.items()],
        ),
    ]


def differences(claim: Claim, grid: Grid | None) -> str:
    return "; ".join(d if isinstance(d, str) else d(claim, grid) for d in claim.differs)


def noise_section(grids: dict[str, Grid]) -> list[str]:
    """What rerun_spread.json measured, at the windows the claims use."""
    record = read_json(SPREAD_FILE)
    if not record or not record.get("spread"):
        return [
            "Not measured yet (`python reproduction/rerun_spread.py` writes "
            "`reproduction/rerun_spread.json`): the noise margins below are the seeds' "
            "t-intervals alone."
        ]
    windows = sorted({grids[c.grid].last for c in CLAIMS if c.grid in grids})
    pairs = [p for entry in record["runs"].values() for p in entry["pairs"]]
    rows = []
    for kind, found in record["spread"].items():
        cells = [kind, ", ".join(found.get("runs", []))]
        for metric in rerun_spread.METRICS:
            m = found.get(metric) or {}
            cells += [fmt(m["window"].get(str(w))) if m else "-" for w in windows]
        acc = found.get("accuracy") or {}
        cells += [fmt(acc.get("round_1")), fmt(acc.get("any_round"))]
        alike = [p["bitwise"] for p in pairs if p["kind"] == kind]
        cells.append(f"{sum(alike)} of {len(alike)}")
        rows.append(cells)
    reruns = [r for entry in record["runs"].values() for r in entry["reruns"]]
    where = "; ".join(dict.fromkeys(
        f"{', '.join(r['cpu'])} at {', '.join(r['commit'])}, torch {', '.join(r['torch'])}, "
        f"{', '.join(r['threads'])} thread(s)"
        for r in reruns
    ))  # fmt: skip
    seeds = sorted({entry["seed"] for entry in record["runs"].values()})
    lines = [
        "Measured by `python reproduction/rerun_spread.py` "
        "([rerun_spread.md](rerun_spread.md), [rerun_spread.json](rerun_spread.json)): each "
        "run listed was run again with its own configuration, seed and partition (partition "
        f"digest checked) on {where}; {len(reruns)} reruns, seeds {seeds}. The largest gap "
        "(points) between two runs of one configuration, seed and partition, for each kind of "
        "difference between them:",
        "",
        *table(
            ["kind", "runs", *(f"{metric}, last {w}" for metric in rerun_spread.METRICS
                               for w in windows), "accuracy, round 1", "accuracy, any round",
             "pairs bitwise identical"],
            rows,
        ),  # fmt: skip
        "",
        "The spread was measured on the runs listed, not on every grid: a claim of another "
        "grid (another dataset, model or method) is judged with it as the best measure at "
        "hand. A kind no rerun measured is stood in for by the broadest kind measured, and "
        "the claim's margin says so.",
    ]
    return lines


def build(grids: dict[str, Grid]) -> str:
    lines = [
        "# Reproduction study",
        "",
        "Written by `python reproduction/make_report.py` from the run folders in "
        "`reproduction/runs/`; do not edit by hand. Each grid is a committed compare file in "
        "`reproduction/`; `fedskew compare -c reproduction/<grid>.toml` runs what is missing "
        "(runs resume), `--report-only` rebuilds its tables, `fedskew report "
        "reproduction/runs/<grid>` its curves.",
        "",
        "## Scale",
        "",
        "Everything here ran on the CPU named in the provenance table below (no GPU was "
        "available), so each paper's setting is scaled down where the table says; the "
        "papers' figures are quoted, not rerun. The last column shows how far from converged "
        "the shortened runs stop: while the accuracy still gains points per round, a verdict "
        "speaks of early training, not of the accuracy the papers report after 100-200 rounds.",
        "",
        *scale_section(grids),
        "",
        "## Claims and verdicts",
        "",
        "Accuracy is the global model's on the uniform test set (client_dist_accuracy: on test "
        "sets weighted by each client's label distribution), in %, the mean of the last rounds "
        "given by each compare file's `last`, mean ± std over the seeds that finished every "
        "run the claim needs. Difference: paired by seed (same partition and initial model); "
        "its mean over the seeds is the claim's lead. The runs of one claim may come from "
        "different machines and commits, which train through different floating-point "
        "kernels and code: the column 'runs from' says, from the run folders' "
        "processes.jsonl, whether they came from one machine (recorded CPU model) and one "
        "clean commit, and if not which machine and commit computed which runs. "
        "Verdict rule: a lead is **within noise** when its size is at most the noise margin, "
        "the larger of (a) the rerun spread that the claim's runs admit: the largest gap, "
        "over the same last rounds, measured between two runs of one configuration, seed and "
        f"partition ({SAME}: two reruns here; another commit or a modified tree on one CPU "
        "model; another machine; see Noise below; a single run's gap, not doubled for the "
        "pair, as a mean over seeds of differences of runs that move independently moves "
        "less than one run does); a claim whose runs came from one machine "
        "and one clean commit admits the first, one from several commits or a modified tree "
        "on one CPU model the first two, one from several machines all three; and (b) the "
        f"half-width of the {100 * LEVEL:g} % Student-t interval of the mean paired difference "
        "over its seeds (none with one seed). Outside the margin: **reproduced** when the "
        "claimed method is ahead on average and on every seed; **partly** when ahead on "
        "average or on some seeds; **not reproduced** otherwise. "
        "A seed where a run diverged (NaN; the run stops) has no accuracy and stays out of the "
        "means, but it counts as lost when the claimed method diverged and as won when only a "
        "method it is compared with did. A claim that a method is the best of several counts "
        "a seed as lost as soon as one finished rival is ahead of it, before the seed's other "
        "runs finish (they could only add rivals); such a seed also stays out of the means. "
        "Such seeds have no paired number for the margin to speak of: where a claim has one, "
        "its seeds' outcomes decide and no lead is called within noise. "
        "A claim of two methods being alike is "
        f"**reproduced** when their mean difference is within {SIMILAR_POINTS:g} point (its "
        "noise margin is shown, not used). "
        "The last column lists how the setting differs from the paper's, the likely reasons "
        "for a gap; nothing here tests which of them it is.",
        "",
        "### Noise: the rerun spread",
        "",
        *noise_section(grids),
        "",
    ]
    spread = read_spread()
    outcomes = [(claim, judge(claim, grids.get(claim.grid), spread)) for claim in CLAIMS]
    lines += summary_section(outcomes)
    lines.append("")
    rows = []
    for claim, o in outcomes:
        where = f"{claim.grid}" + (f" / {claim.setting}" if claim.setting else "")
        rows.append(
            [claim.paper, claim.text, f"{claim.quoted} (paper)", where, o.ours, o.theirs,
             o.difference, o.margin, o.seeds, f"**{o.verdict}**", o.origin,
             differences(claim, grids.get(claim.grid))]
        )  # fmt: skip
    lines += table(
        ["paper", "claim", "the paper says", "grid", "ours", "against", "difference (points)",
         "noise margin (points)", "seeds", "verdict", "runs from",
         "differences from the paper"],
        rows,
    )  # fmt: skip
    lines += ["", "## Tuning: FedFM and FedAvg with the same budget", "", *tuning_section()]
    lines += ["", "## Still to run", "", *pending_section(grids, outcomes)]
    lines += [
        "",
        "## FedFM's stability: where lam = 50 breaks",
        "",
        "Three candidate remedies, all off by default so that the paper's behaviour stays "
        "reproducible: `lam_warmup` (FedFM, FedFM-Lite and the plug-in), which grows lam "
        "linearly over that many rounds from the launching round; the run option `grad_clip` "
        "(clips each local step's gradient norm; any method); and FedFM's `match_on = "
        "pre_relu`, which takes the anchors and the matching term on the body's output before "
        "its last ReLU (after the BatchNorm on the bn model) instead of the post-ReLU features, "
        "whose class means all lie in the positive orthant. Their comparison over seeds is the "
        'fedfm-warmup, fedfm-clip10 and fedfm-prerelu rows of the claims table ("FedFM '
        '(remedy)"); fedavg-clip10 is the control for what clipping does without FM.',
        "",
        *stability_section(grids),
        "",
        "At the launching round (the first round with the matching term): accuracy of the "
        "global model before and after it, and how far apart the global anchors it matched "
        "against were: the largest cosine between two anchors, and the CG floor, the mean CG "
        "loss of a feature lying exactly on its own anchor (log 10 = 2.30 when all anchors "
        "point the same way, near 0 when they are well apart). lam x the floor is what the "
        "matching term costs even for perfectly matched features.",
        "",
        *launch_section(grids),
        "",
        "## FedACD's measures",
        "",
        "The global model's accuracy on the uniform test set (Table 1 of the paper) and on "
        "test sets weighted by each client's label distribution (Table 2), and the mean risk "
        "of the round's local models over their clients' distributions (Table 3, Eq. 3; lower "
        "is better), at the last round.",
        "",
        *measures_section(grids.get("fedacd-cifar10")),
        "",
        "## Per-class view: minority and majority classes",
        "",
        "The global model's per-class test accuracy, each run's mean over the grid's last "
        "rounds (`last` of its compare file), averaged over the minority half and over the "
        "majority half of the classes, then mean ± std over the seeds that finished; the "
        "gap is taken per seed, the lowest class is each run's worst class. Each seed's "
        "classes are ranked by their share of the training data in its partition when the "
        f"class totals differ (the largest at least {SAMPLES_DIFFER:g} times the smallest), "
        "else by how many clients hold the class (a Dirichlet split hands out every sample, "
        "so only that differs); the minority half is the floor(C/2) classes ranked lowest, "
        "the majority half the floor(C/2) ranked highest. The partitions are rebuilt from "
        "each run's config.json and counted against the dataset's labels (the same rule and "
        "code as `fedskew report`: `src/fedskew/report/per_class.py`). No verdict above uses "
        "these numbers.",
        "",
        *per_class_section(grids),
        "",
        "## Tables and curves of each grid",
        "",
    ]
    for name in GRIDS:
        root = RUNS / name
        files = [p for p in ("comparison.md", "report.md") if (root / p).exists()]
        if files:
            links = ", ".join(f"[{p}](runs/{name}/{p})" for p in files)
            lines.append(f"- {name}: {links}")
        else:
            lines.append(f"- {name}: not run yet")
    lines += [
        "",
        "## Provenance: which machine ran which rounds",
        "",
        "As the run folders record it (processes.jsonl).",
        "",
        *provenance_section(grids),
        "",
    ]
    return "\n".join(lines)


def refresh_reports(grids: dict[str, Grid]) -> None:
    for name in grids:
        file = GRIDS[name][0]
        for cmd in (
            ["compare", "-c", file, "--report-only"],
            ["report", f"reproduction/runs/{name}"],
        ):
            subprocess.run([sys.executable, "-m", "fedskew", *cmd], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reports", action="store_true", help="also rebuild each grid's tables and report"
    )
    args = parser.parse_args()
    grids = read_grids()
    if args.reports:
        refresh_reports(grids)
        grids = read_grids()
    OUT.write_text(build(grids), encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
