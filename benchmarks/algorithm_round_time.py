"""Every registered algorithm's round time relative to FedAvg's, next to the extra work its
code does per round (counted from the code: the EXTRA_WORK table below).

Experiment (issue 6's, with E configurable): Fashion-MNIST, simple-cnn, 20 clients,
Dirichlet beta 0.1, 8 clients per round, E local epochs (default 2), batch 64, lr 0.01,
momentum 0.9, weight decay 1e-5, seed 0 (so every algorithm trains the same clients on the
same partition in the same rounds), the global model evaluated every round. Each
(algorithm, repeat) is one ``fedskew run`` child process with OMP_NUM_THREADS=--threads.
Algorithms' own defaults, except the launching round of FedFM / FedFM-Lite (``-p
start_round=0``, so that the measured rounds include the feature-matching term; by default it
starts at round 20).

Round time = median of metrics.jsonl ``seconds`` over rounds 2..R (round 1 warms up; the
engine's evaluation of the global model is not in ``seconds``, but work an algorithm does
inside its round is, e.g. FedROD's personalised evaluation). Ratio = an algorithm's round
time / FedAvg's in the same repeat. To keep machine drift out of the ratios, FedAvg runs at the
start, middle and end of every repeat (its reference is the median of those three), and the
order of the other algorithms is reversed in every other repeat; the reported ratio is the
median over repeats, with the range.

Time on a 2-core machine, roughly: a FedAvg round (8 clients x ~3,000 samples) took ~3 s per
local epoch in a smoke run on a busy machine with 1 thread, so with the defaults (E = 2, 5
rounds, 2 repeats of 17 algorithms + 3 FedAvg runs, each run also starting up and evaluating
every round; FedACD, FedFM, MOON, FedNTD slower) expect 30-40 minutes. ``-e 5`` as in issue
6's throughput experiment takes about 2.5 times as long.

    python benchmarks/algorithm_round_time.py [-r 5] [-e 2] [--repeat 2] [--threads 2]
        [--algorithms fedavg,moon,...]

Writes ``benchmarks/results/algorithm_round_time.md`` and ``.json`` (``--out``); run folders
and logs go to ``benchmarks/out/algorithm_round_time/`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import REPO, command_text, read_metrics, run_child  # noqa: E402
from machine import machine_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORK = Path("benchmarks", "out", "algorithm_round_time")  # relative to REPO

# Parameters that put an algorithm in its steady state within a few rounds (scale.py uses
# them too): FedFM's matching term starts at round 20 by default.
STEADY_ARGS: dict[str, list[str]] = {
    "fedfm": ["-p", "start_round=0"],
    "fedfm-lite": ["-p", "start_round=0"],
}


@dataclass(frozen=True)
class ExtraWork:
    """What an algorithm's round does beyond FedAvg's (E epochs of SGD, one exchange).

    ``fixed_passes`` + ``passes_per_epoch`` * E is the number of extra forward passes (no
    gradient) over all of a client's local data per round; a pass of the body alone counts as
    one. ``per_step`` is extra work inside each SGD step that is not a pass over the data.
    """

    fixed_passes: float
    passes_per_epoch: float
    passes: str  # the same, in words
    per_step: str
    exchanges: str  # channel exchanges per round (FedAvg: 1)
    server: str  # server work beyond averaging
    where: str  # the code that does it (src/fedskew/algorithms/...)

    def extra_passes(self, epochs: int) -> float:
        return self.fixed_passes + self.passes_per_epoch * epochs


NONE = "-"

EXTRA_WORK: dict[str, ExtraWork] = {
    # fedavg.py FedAvgClient.on_train: set_arrays, train_client, get_arrays. The reference.
    "fedavg": ExtraWork(0, 0, "0", NONE, "1", NONE, "fedavg.py FedAvgClient.on_train"),
    # fedprox.py proximal_loss: mu/2 ||w - w_t||^2 over the parameters at every step;
    # FedProxClient.on_train clones the received parameters once per round.
    "fedprox": ExtraWork(
        0, 0, "0", "proximal term over all parameters", "1", NONE,
        "fedprox.py proximal_loss, FedProxClient.on_train",
    ),
    # feddyn.py dynamic_loss: <g_k, w> and alpha/2 ||w - w_t||^2 over the parameters per step;
    # FedDynServer.round: the correction h (one pass over the model per round).
    "feddyn": ExtraWork(
        0, 0, "0", "linear + quadratic term over all parameters", "1", "update h",
        "feddyn.py dynamic_loss, FedDynClient.on_train, FedDynServer.round",
    ),
    # scaffold.py ScaffoldClient.on_train.correct (before_step hook): grad += c - c_k per step;
    # the message carries c down and delta c_k up (about 2x FedAvg's bytes).
    "scaffold": ExtraWork(
        0, 0, "0", "gradient correction (one add per parameter tensor)", "1", "update c",
        "scaffold.py ScaffoldClient.on_train (correct), ScaffoldServer.round",
    ),
    # fednova.py FedNovaClient.on_train: normalised update after training, nothing per step.
    "fednova": ExtraWork(
        0, 0, "0", NONE, "1", "normalised averaging",
        "fednova.py FedNovaClient.on_train, FedNovaServer.round",
    ),
    # feddecorr.py decorrelation_loss: d x d correlation of the batch features per step.
    "feddecorr": ExtraWork(
        0, 0, "0", "d x d feature correlation", "1", NONE,
        "feddecorr.py decorrelation_loss (in FedDecorrClient.on_train's loss_fn)",
    ),
    # fedlc.py FedLCClient.on_train.loss_fn: logits - margins per step.
    "fedlc": ExtraWork(
        0, 0, "0", "logit shift", "1", NONE, "fedlc.py FedLCClient.on_train (loss_fn)"
    ),
    # fedrs.py FedRSClient.on_train.loss_fn: logits * factors per step.
    "fedrs": ExtraWork(
        0, 0, "0", "logit scaling", "1", NONE, "fedrs.py FedRSClient.on_train (loss_fn)"
    ),
    # fedntd.py FedNTDClient.on_train.loss_fn: `glob(x)` under no_grad, the frozen global
    # model's forward on every batch: one extra forward of the data per epoch.
    "fedntd": ExtraWork(
        0, 1, "E (teacher forward in every step)", "not-true KL", "1", NONE,
        "fedntd.py FedNTDClient.on_train (loss_fn: glob(x))",
    ),
    # moon.py MoonClient.on_train.loss_fn: glob.body+projection and prev.body+projection under
    # no_grad on every batch, skipped on a client's first participation (has_prev False).
    "moon": ExtraWork(
        0, 2, "2E (global and previous model, body + projection, every step; "
        "0 on a client's first round)",
        "contrastive loss", "1", NONE, "moon.py MoonClient.on_train (loss_fn)",
    ),
    # fedrod.py FedRODClient.on_train: personal head on detached features per step; on
    # evaluation rounds personal_accuracy -> metrics.evaluation.evaluate over the whole test
    # set (ctx.test_x) on every client: not local data, but inside the round.
    "fedrod": ExtraWork(
        0, 0, "0 (+ one pass over the test set per client on evaluation rounds)",
        "personal linear head", "1", NONE,
        "fedrod.py FedRODClient.on_train, personal_accuracy",
    ),
    # fedproto.py FedProtoClient.on_train: class_feature_means (body, no grad, all local
    # data) after training; prototype_regulariser per step.
    "fedproto": ExtraWork(
        1, 0, "1 (body, after training: class means)", "prototype distance", "1",
        "count-weighted prototypes", "fedproto.py FedProtoClient.on_train (class_feature_means)",
    ),
    # fednh.py FedNHClient.on_train: scaled_class_means (body, no grad, all local data) after
    # training; the cosine PrototypeHead replaces the linear head.
    "fednh": ExtraWork(
        1, 0, "1 (body, after training: class means)", "cosine head", "1",
        "prototype update", "fednh.py FedNHClient.on_train (scaled_class_means)",
    ),
    # feature_matching.py FMClient._fm_local_anchors -> local_anchor_arrays ->
    # local.class_feature_means (body, no grad, all local data) with the global model, in an
    # extra exchange before training (FMServer.round), every round; cg_loss per step from
    # start_round on.
    "fedfm": ExtraWork(
        1, 0, "1 (body, round start: anchors)", "contrastive guiding on features", "2",
        "anchor aggregation",
        "feature_matching.py FMClient._fm_local_anchors, FMServer.round, cg_loss",
    ),
    # fedfm_lite.py FedFMLiteClient.on_lite_train: local_anchor_arrays after training (body,
    # no grad, all local data); models travel only every `a` rounds (5).
    "fedfm-lite": ExtraWork(
        1, 0, "1 (body, after training: anchors)", "contrastive guiding on features", "1",
        "anchor aggregation; model average every a rounds",
        "fedfm_lite.py FedFMLiteClient.on_lite_train",
    ),
    # fedacd.py FedACDClient.plain_train: soft_confusion (body + head, no grad, all local
    # data) before training (margin=true) and after training (weighting != uniform);
    # acd_loss per step: mixup of the batch, flat KL, CE on both mixed labels (one forward);
    # add_to_confusion after it.
    "fedacd": ExtraWork(
        2, 0, "2 (full model: P at round start, score after training)",
        "mixup, flat KL, two CE on one forward, confusion sums", "1", "score weights",
        "fedacd.py FedACDClient.plain_train (soft_confusion x2), acd_loss",
    ),
    # fedcme.py FedCMEClient.finish: class_feature_means (body, no grad, all local data,
    # mu > 0) and client_eval_vector (full model, no grad, on eval_fraction = 0.2 of the data);
    # on_evaluate: the same 0.2 evaluation for clients without a stored vector (cold start,
    # an extra exchange); FedCMEServer.round: train_first + train_rest exchanges (E >= 2), a
    # fresh optimiser for the second half; alignment_loss per step.
    "fedcme": ExtraWork(
        1.2, 0, "1 (body: class means) + 0.2 (eval subset), +0.2 on a client's first round; "
        "E = 1: 1",
        "feature alignment", "2 (+1 in rounds with new clients; 1 when E = 1)",
        "matching, feature memory",
        "fedcme.py FedCMEClient.finish, on_evaluate, FedCMEServer.round",
    ),
    # creff.py CReFFClient.on_train -> real_class_gradients (body, no grad, all local data)
    # before training; CReFFServer.match (match_epochs = 100 gradient-matching steps on
    # C x 100 synthetic features) and CReFFServer.retrain (crt_epochs = 300 epochs of a linear
    # classifier on them, batch = the clients' batch size).
    "creff": ExtraWork(
        1, 0, "1 (body, before training: per-class gradients)", NONE, "1",
        "100 matching steps + 300 epochs of classifier re-training",
        "creff.py CReFFClient.on_train (real_class_gradients), CReFFServer.match, .retrain",
    ),
}  # fmt: skip


def setting(args: argparse.Namespace) -> list[str]:
    argv = [
        "-d", args.dataset, "-m", args.model, "-n", "20", "--clients-per-round", "8",
        "--partition", "dirichlet", "--beta", "0.1", "-e", str(args.local_epochs), "-b", "64",
        "--lr", "0.01", "--momentum", "0.9", "--weight-decay", "1e-5", "-r", str(args.rounds),
        "--seed", "0", "--eval-every", str(args.eval_every), "--checkpoint-every", "0", "-q",
    ]  # fmt: skip
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    return argv


def schedule(algorithms: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, algorithm) in run order: FedAvg first, middle and last of every repeat, the
    others reversed in every other repeat."""
    others = [a for a in algorithms if a != "fedavg"]
    order = []
    for rep in range(repeats):
        seq = others if rep % 2 == 0 else others[::-1]
        half = len(seq) // 2
        for name in ["fedavg", *seq[:half], "fedavg", *seq[half:], "fedavg"]:
            order.append((rep, name))
    return order


def measure(rep: int, k: int, algorithm: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"r{rep}-{k:02d}-{algorithm}"
    out_dir = WORK / "runs" / name
    shutil.rmtree(REPO / out_dir, ignore_errors=True)
    argv = [
        sys.executable, "-m", "fedskew", "run", "-a", algorithm, *STEADY_ARGS.get(algorithm, []),
        *setting(args), *shlex.split(args.run_args), "-o", str(out_dir), "--name", name,
    ]  # fmt: skip
    rc, wall, peak, _ = run_child(argv, args.threads, REPO / WORK / f"{name}.log", poll_s=0)
    records = read_metrics(out_dir)
    measured = records[1:] if len(records) > 1 else records
    row: dict[str, Any] = {
        "repeat": rep + 1,
        "algorithm": algorithm,
        "command": command_text(argv, args.threads),
        "rc": rc,
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(peak / 2**20, 1),  # the largest single process
        "rounds_done": len(records),
    }
    if rc != 0:
        row["log"] = str(WORK / f"{name}.log")
    if measured:

        def med(key: str) -> float | None:
            values = [r[key] for r in measured if key in r]
            return statistics.median(values) if values else None

        row.update(
            round_s=med("seconds"),
            eval_s=med("eval_seconds"),
            samples=med("samples"),
            bytes_down=med("bytes_down"),
            bytes_up=med("bytes_up"),
            exchanges=med("exchanges"),
            round_seconds=[r["seconds"] for r in records],
            accuracy_last=records[-1].get("accuracy"),
        )
    return row


def summarise(runs: list[dict[str, Any]], algorithms: list[str], epochs: int) -> list[dict]:
    ok = [r for r in runs if r["rc"] == 0 and r.get("round_s")]
    reference = {}  # repeat -> FedAvg's round time (median of its runs in that repeat)
    for rep in {r["repeat"] for r in ok}:
        times = [r["round_s"] for r in ok if r["repeat"] == rep and r["algorithm"] == "fedavg"]
        if times:
            reference[rep] = statistics.median(times)
    fedavg_bytes = next((r for r in ok if r["algorithm"] == "fedavg"), None)
    rows = []
    for algorithm in algorithms:
        mine = [r for r in ok if r["algorithm"] == algorithm]
        ratios = [r["round_s"] / reference[r["repeat"]] for r in mine if r["repeat"] in reference]
        work = EXTRA_WORK.get(algorithm)
        row: dict[str, Any] = {
            "algorithm": algorithm,
            "runs": len(mine),
            "failed": sum(1 for r in runs if r["algorithm"] == algorithm and r["rc"] != 0),
            "round_s": statistics.median(r["round_s"] for r in mine) if mine else None,
            "ratio": round(statistics.median(ratios), 3) if ratios else None,
            "ratio_min": round(min(ratios), 3) if ratios else None,
            "ratio_max": round(max(ratios), 3) if ratios else None,
            "samples_per_s": (
                round(statistics.median(r["samples"] / r["round_s"] for r in mine))
                if mine
                else None
            ),
            "extra_passes_at_E": work.extra_passes(epochs) if work else None,
            "work": asdict(work) if work else None,
            "command": mine[0]["command"] if mine else None,
        }
        if mine and fedavg_bytes:
            down = fedavg_bytes.get("bytes_down") or 1
            up = fedavg_bytes.get("bytes_up") or 1
            row["bytes_down_vs_fedavg"] = round(mine[0]["bytes_down"] / down, 3)
            row["bytes_up_vs_fedavg"] = round(mine[0]["bytes_up"] / up, 3)
            row["exchanges"] = mine[0]["exchanges"]
        rows.append(row)
    return rows


def report(result: dict[str, Any], out: Path) -> None:
    m = result["machine"]
    smoke = " **(SMOKE RUN: tiny sizes, not a measurement)**" if result["smoke"] else ""
    lines = [
        "# Round time of every algorithm relative to FedAvg",
        "",
        f"Produced by `{result['invocation']}`{smoke}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}; "
        f"Python {m['python']}; each run a child process with OMP_NUM_THREADS={result['threads']}",
        f"- Setting: {result['setting']}",
        "- Round time: median of metrics.jsonl `seconds` over rounds 2..R (the engine's "
        "evaluation excluded; work inside the algorithm's round included). Ratio: round time "
        "/ FedAvg's in the same repeat (FedAvg run first, middle and last of each repeat), "
        "median over repeats [range].",
        "- Extra passes: forward passes without gradient over all of a client's local data per "
        "round beyond the E training epochs, counted from the code (`EXTRA_WORK` in the "
        f"script); the number is at E = {result['epochs']}. A pass of the body alone counts "
        "as one.",
        "",
        "| algorithm | ratio [range] | round (s) | samples/s | extra passes (at E) "
        "| extra passes | per-step extra | exchanges | bytes down / up vs FedAvg "
        "| server extra | code |",
        "|---|---:|---:|---:|---:|---|---|---:|---|---|---|",
    ]
    for r in result["summary"]:
        w = r["work"] or {}
        if r["ratio"] is None:
            measured = f"no data ({r['failed']} failed) | | |"
        else:
            measured = (
                f"**{r['ratio']:.2f}** [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | "
                f"{r['round_s']:.2f} | {r['samples_per_s']:,}"
            )
        traffic = (
            f"{r['bytes_down_vs_fedavg']:.2f} / {r['bytes_up_vs_fedavg']:.2f}"
            if "bytes_down_vs_fedavg" in r
            else ""
        )
        lines.append(
            f"| {r['algorithm']} | {measured} | {r['extra_passes_at_E']} | "
            f"{w.get('passes', '?')} | {w.get('per_step', '?')} | {w.get('exchanges', '?')} "
            f"(measured {r.get('exchanges', '?')}) | {traffic} | {w.get('server', '?')} | "
            f"`{w.get('where', '?')}` |"
        )
    lines += [
        "",
        "Notes: MOON skips its two frozen forward passes on a client's first participation, "
        "so with 20 clients and 8 per round its early rounds are cheaper than its steady "
        "state. FedFM and FedFM-Lite run with `-p start_round=0` so that the measured rounds "
        "include the matching term. FedROD's round includes its personalised evaluation on "
        "the test set (every client, every evaluation round).",
        "",
        "## Commands",
        "",
    ]
    for run in result["runs"]:
        status = "" if run["rc"] == 0 else f" (exit {run['rc']}, see {run.get('log')})"
        lines.append(f"- repeat {run['repeat']}, {run['algorithm']}{status}: `{run['command']}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-e", "--local-epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="repeats of the whole schedule")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="OMP_NUM_THREADS (default: cores)"
    )
    ap.add_argument("--eval-every", type=int, default=1, help="as fedskew run's (issue 6: 1)")
    ap.add_argument("--algorithms", default=None, help="comma list (default: all registered)")
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--model", default="simple-cnn")
    ap.add_argument(
        "--run-args",
        default="",
        help="more `fedskew run` options for every run, e.g. '--workers 2'",
    )
    ap.add_argument("--smoke", action="store_true", help="label the report as a smoke run")
    ap.add_argument("--out", default=str(RESULTS / "algorithm_round_time.md"))
    args = ap.parse_args()

    from fedskew.algorithms import ALGORITHMS

    missing = sorted(set(ALGORITHMS) - set(EXTRA_WORK))
    if missing:  # a new algorithm must have its extra work counted before it is measured
        sys.exit(f"EXTRA_WORK has no entry for: {', '.join(missing)}")
    unknown = sorted(set(EXTRA_WORK) - set(ALGORITHMS))
    if unknown:
        print(f"note: EXTRA_WORK lists algorithms that are not registered: {unknown}")
    algorithms = args.algorithms.split(",") if args.algorithms else list(ALGORITHMS)
    if "fedavg" not in algorithms:
        algorithms = ["fedavg", *algorithms]

    out = Path(args.out).resolve()
    os.chdir(REPO)
    runs = []
    for k, (rep, algorithm) in enumerate(schedule(algorithms, args.repeat)):
        row = measure(rep, k, algorithm, args)
        runs.append(row)
        print(
            f"repeat {rep + 1} {algorithm:<11} rc {row['rc']} round {row.get('round_s')} s "
            f"(rounds {row.get('round_seconds')})",
            flush=True,
        )
    result = {
        "machine": machine_facts(),
        "invocation": "python benchmarks/algorithm_round_time.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "smoke": args.smoke,
        "threads": args.threads,
        "epochs": args.local_epochs,
        "setting": f"{args.dataset}, {args.model}, 20 clients, dirichlet beta 0.1, 8 per "
        f"round, E={args.local_epochs}, batch 64, lr 0.01, momentum 0.9, weight decay 1e-5, "
        f"seed 0, {args.rounds} rounds, evaluation every {args.eval_every}, fp32"
        + (f", {args.run_args}" if args.run_args else ""),
        "summary": summarise(runs, algorithms, args.local_epochs),
        "runs": runs,
        "extra_work": {k: asdict(v) for k, v in EXTRA_WORK.items()},
    }
    report(result, out)


if __name__ == "__main__":
    main()
