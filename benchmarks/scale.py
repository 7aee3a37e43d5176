"""Scale figures of issue 6: partition time, peak memory and round time at 1,000 and 10,000
clients, and the memory of the per-client state each algorithm keeps.

Three parts (``--parts partition,memory,state``, all by default):

1. partition: ``fedskew.data.partition.make_partition`` on Fashion-MNIST's 60,000 training
   labels, timed in this process with ``time.perf_counter`` (best and median of
   ``--partition-repeat`` calls after one untimed call) at 1,000 and 10,000 clients:
   Dirichlet beta 0.1 with min_size 10 (the default; infeasible at 10,000 clients, which would
   need 100,000 samples), 5 and 1; quantity skew beta 0.5; 2 shards per client; IID.
2. memory: FedAvg (and any ``--memory-algorithms``) as one ``fedskew run`` child process per
   configuration, so that peaks do not mix: 20, 1,000 and 10,000 clients, 10 per round,
   ``--rounds`` rounds, 1 local epoch, simple-cnn, Dirichlet 0.1 with min_size 1 (for all
   three, as 10 is infeasible at 10,000 clients), batch 64, lr 0.01. Peak memory is the
   child's max RSS (``os.wait4``); a child that only imports fedskew and loads the dataset
   gives the floor. Round time is the median of metrics.jsonl ``seconds`` over rounds 2..R
   (round 1 warms up). Clients hold ~3,000 samples at 20 clients and ~6 at 10,000, so a
   round's data differs 500-fold: samples per round, seconds per 1,000 samples and seconds
   per sampled client are reported next to it. Round time independent of the total number of
   clients means: at the same clients per round, the time per client and per sample does not
   grow with the total.
3. state: every registered algorithm, 1,000 clients, 10 per round, ``--state-rounds`` rounds,
   2 local epochs (FedCME exchanges parts only when E >= 2), FedFM / FedFM-Lite with
   ``-p start_round=0`` (FedFM keeps anchors in client state once matching runs), run in this
   process through the CLI's own parser (the config is exactly that of the printed
   ``fedskew run`` command) with a checkpoint after every round; after each round the
   checkpoint is read back (``fedskew.runs.checkpoint.load_checkpoint``) and the bytes of
   every client's ``ClientState`` counted (``ClientState.nbytes``: tensor bytes + 8 per
   scalar). Reported per algorithm: the largest state a client held after any round, which
   entries it is made of, how many clients hold state against how many were ever sampled (the
   engine makes a client's state on its first message), and server-side entries kept per
   client (dicts keyed by client id in the server's checkpoint fields). State of 10,000 clients
   is projected as bytes per client x 10,000 (every client sampled at least once).

Time on a 2-core machine, roughly (from smoke runs on a busy one): partition ~10 s; memory
with 5 rounds: ~30-60 s for the 20-client run (30,000 samples a round), ~10 s each for 1,000
and 10,000 clients; state ~1-2 minutes (18 algorithms x 4 rounds of 10 small clients). Under
5 minutes in all.

    python benchmarks/scale.py [--parts partition,memory,state] [--rounds 5] [--threads 2]

Writes ``benchmarks/results/scale.md`` and ``scale.json`` (``--out``); run folders and logs
go to ``benchmarks/out/scale/`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import REPO, command_text, read_metrics, run_child  # noqa: E402
from machine import machine_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORK = Path("benchmarks", "out", "scale")  # relative to REPO, the working directory

# (scheme, parameters) timed at every client count; infeasible ones are reported as such.
PARTITION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("dirichlet", {"beta": 0.1, "min_size": 10}),
    ("dirichlet", {"beta": 0.1, "min_size": 5}),
    ("dirichlet", {"beta": 0.1, "min_size": 1}),
    ("quantity", {"beta": 0.5, "min_size": 1}),
    ("shards", {"shards_per_client": 2}),
    ("iid", {}),
]


def ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def mib(n: float) -> float:
    return round(n / 2**20, 1)


# --------------------------------------------------------------------------- 1. partition


def part_partition(args: argparse.Namespace) -> dict[str, Any]:
    from fedskew.core.errors import UsageError
    from fedskew.data.partition import make_partition
    from fedskew.data.sources import load_dataset

    data = load_dataset(args.dataset, args.data_dir)
    labels = data.y_train.numpy()
    rows = []
    for clients in args.partition_clients:
        for scheme, params in PARTITION_CASES:
            call = (
                f"make_partition(y_train, {clients}, {scheme!r}, seed=0, "
                f"num_classes={data.num_classes}"
                + "".join(f", {k}={v!r}" for k, v in params.items())
                + ")"
            )
            row: dict[str, Any] = {
                "clients": clients,
                "scheme": scheme,
                "params": params,
                "call": call,
            }
            try:
                make_partition(labels, clients, scheme, 0, data.num_classes, **params)
            except UsageError as exc:
                row["infeasible"] = str(exc)
                rows.append(row)
                continue
            times = []
            for _ in range(args.partition_repeat):
                t0 = time.perf_counter()
                part = make_partition(labels, clients, scheme, 0, data.num_classes, **params)
                times.append(time.perf_counter() - t0)
            sizes = [len(p) for p in part]
            row.update(
                best_s=round(min(times), 4),
                median_s=round(statistics.median(times), 4),
                min_client=min(sizes),
                max_client=max(sizes),
            )
            rows.append(row)
            print(f"partition {clients:>6} {scheme:<9} {params}: {row['median_s']:.3f} s")
    return {"labels": int(labels.size), "repeat": args.partition_repeat, "rows": rows}


# --------------------------------------------------------------------------- 2. memory


def run_argv(
    algorithm: str, clients: int, args: argparse.Namespace, out_dir: Path, name: str
) -> list[str]:
    argv = [
        sys.executable, "-m", "fedskew", "run", "-a", algorithm, "-d", args.dataset,
        "-m", args.model, "-n", str(clients), "--clients-per-round", str(args.per_round),
        "--partition", "dirichlet", "--beta", "0.1", "--min-size", str(args.min_size),
        "-r", str(args.rounds), "-e", "1", "-b", "64", "--lr", "0.01", "--momentum", "0.9",
        "--seed", "0", "--eval-every", str(args.rounds), "--checkpoint-every", str(args.rounds),
        "-q", *shlex.split(args.run_args), "-o", str(out_dir), "--name", name,
    ]  # fmt: skip
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    return argv


def part_memory(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    where = f', "{args.data_dir}"' if args.data_dir else ""
    floor_argv = [
        sys.executable, "-c",
        f'from fedskew.data.sources import load_dataset; load_dataset("{args.dataset}"{where})',
    ]  # fmt: skip
    rc, wall, peak, _ = run_child(floor_argv, args.threads, WORK / "floor.log")
    floor = {
        "what": f"import fedskew + load {args.dataset}",
        "command": command_text(floor_argv, args.threads),
        "rc": rc,
        "peak_rss_mib": mib(peak),
        "wall_s": round(wall, 2),
    }
    print(f"floor: {floor['peak_rss_mib']} MiB")
    for algorithm in args.memory_algorithms:
        for clients in args.clients:
            name = f"{algorithm}-n{clients}"
            out_dir = WORK / "runs" / name
            shutil.rmtree(out_dir, ignore_errors=True)
            argv = run_argv(algorithm, clients, args, out_dir, name)
            rc, wall, peak, tree = run_child(argv, args.threads, WORK / f"{name}.log")
            records = read_metrics(out_dir)
            row: dict[str, Any] = {
                "algorithm": algorithm,
                "clients": clients,
                "per_round": args.per_round,
                "command": command_text(argv, args.threads),
                "rc": rc,
                "wall_s": round(wall, 2),
                "peak_rss_mib": mib(peak),
                "tree_pss_mib": mib(tree),
                "rounds_done": len(records),
            }
            if rc != 0:
                row["log"] = str(WORK / f"{name}.log")
            measured = records[1:] if len(records) > 1 else records
            if measured:
                secs = statistics.median(r["seconds"] for r in measured)
                samples = statistics.median(r["samples"] for r in measured)
                row.update(
                    round_s=round(secs, 4),
                    rounds_measured=len(measured),
                    samples_per_round=samples,
                    s_per_1000_samples=round(1000 * secs / samples, 4) if samples else None,
                    ms_per_client=round(1000 * secs / len(measured[0]["clients"]), 2),
                )
            rows.append(row)
            print(
                f"memory {algorithm} n={clients}: rc {rc}, peak {row['peak_rss_mib']} MiB, "
                f"round {row.get('round_s')} s, {row.get('samples_per_round')} samples"
            )
    return {"floor": floor, "rows": rows}


# --------------------------------------------------------------------------- 3. state


def key_group(key: str) -> str:
    """A short name for a family of state entries (``scaffold.c_k/*``, ``moon.prev``)."""
    if "/" in key:
        return key.split("/", 1)[0] + "/*"
    return ".".join(key.split(".")[:2])


def tensor_bytes(value: Any) -> int:
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 8  # a number (or None, or a short string) travels as one 8-byte value


def server_per_client(server: dict[str, Any], num_clients: int) -> dict[str, dict[str, Any]]:
    """Server checkpoint fields that are dicts keyed by client id: entries and bytes."""
    out = {}
    for field, value in server.items():
        if field == "global_arrays" or not isinstance(value, dict) or not value:
            continue
        keys = list(value)
        if all(isinstance(k, int) and 0 <= k < num_clients for k in keys):
            total = sum(tensor_bytes(v) for v in value.values())
            out[field] = {
                "clients": len(keys),
                "bytes_total": total,
                "bytes_per_client": round(total / len(keys), 1),
            }
    return out


class StateProbe:
    """The ``on_round`` callback of one state run: reads the checkpoint after every round."""

    def __init__(self, out_dir: Path, num_clients: int) -> None:
        self.out_dir = out_dir
        self.num_clients = num_clients
        self.per_round: list[dict[str, Any]] = []
        self.sampled: set[int] = set()
        self.group_bytes: dict[str, int] = {}  # entry family -> most bytes one client held
        self.model_bytes = 0

    def __call__(self, record: dict[str, Any]) -> None:
        from fedskew.runs.checkpoint import load_checkpoint

        self.sampled.update(record["clients"])
        done, server, clients, _ = load_checkpoint(next(self.out_dir.glob("*/checkpoint.npz")))
        self.model_bytes = tensor_bytes(server["global_arrays"])
        holding = [b for b in (s.nbytes() for s in clients.values()) if b > 0]
        for s in clients.values():
            sums: dict[str, int] = {}
            for key, t in s.arrays.items():
                g = key_group(key)
                sums[g] = sums.get(g, 0) + t.numel() * t.element_size()
            for g, b in sums.items():
                self.group_bytes[g] = max(self.group_bytes.get(g, 0), b)
        self.per_round.append(
            {
                "round": done,
                "sampled_so_far": len(self.sampled),
                "state_entries": len(clients),
                "clients_with_state": len(holding),
                "bytes_total": sum(holding),
                "bytes_per_client_max": max(holding, default=0),
                "bytes_per_client_min": min(holding, default=0),
                "server_per_client": server_per_client(server, self.num_clients),
            }
        )


def measure_state(algorithm: str, args: argparse.Namespace) -> dict[str, Any]:
    from fedskew.apps.cli import load_config, make_parser
    from fedskew.runs.loop import run

    name = f"state-{algorithm}"
    out_dir = WORK / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = run_argv(algorithm, args.state_clients, args, out_dir, name)
    argv[argv.index("-r") + 1] = str(args.state_rounds)
    argv[argv.index("--eval-every") + 1] = str(args.state_rounds)
    argv[argv.index("--checkpoint-every") + 1] = "1"
    argv[argv.index("-e") + 1] = str(args.state_epochs)
    # FedFM's anchors live in client state only once matching has started (round 20).
    from algorithm_round_time import STEADY_ARGS

    i = argv.index("-a") + 2
    argv[i:i] = STEADY_ARGS.get(algorithm, [])
    cfg = load_config(make_parser().parse_args(argv[3:]))  # argv[3:] = ["run", ...]
    probe = StateProbe(out_dir, args.state_clients)
    t0 = time.perf_counter()
    error = None
    try:
        run(cfg, on_round=probe)
    except Exception as exc:  # report it and go on with the other algorithms
        error = f"{type(exc).__name__}: {exc}"
    row: dict[str, Any] = {
        "algorithm": algorithm,
        "command": command_text(argv, args.threads),
        "wall_s": round(time.perf_counter() - t0, 2),
        "model_bytes": probe.model_bytes,
        "per_round": probe.per_round,
    }
    if error:
        row["error"] = error
    if probe.per_round:
        per_client = max(r["bytes_per_client_max"] for r in probe.per_round)
        row.update(
            bytes_per_client=per_client,
            per_client_vs_model=(
                round(per_client / probe.model_bytes, 3) if probe.model_bytes else None
            ),
            entries=dict(sorted(probe.group_bytes.items())),
            projected_10000_mib=mib(per_client * 10_000),
            server_per_client=probe.per_round[-1]["server_per_client"],
        )
    return row


def part_state(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fedskew.algorithms import ALGORITHMS

    torch.set_num_threads(args.threads)
    rows = []
    for algorithm in args.state_algorithms or list(ALGORITHMS):
        row = measure_state(algorithm, args)
        rows.append(row)
        print(
            f"state {algorithm}: {row.get('bytes_per_client', 0):,} bytes/client "
            f"({', '.join(row.get('entries', {})) or 'none'})"
            + (f"  ERROR {row['error']}" if "error" in row else "")
        )
    return {
        "clients": args.state_clients,
        "per_round": args.per_round,
        "rounds": args.state_rounds,
        "epochs": args.state_epochs,
        "rows": rows,
    }


# --------------------------------------------------------------------------- report


def report(result: dict[str, Any], out: Path, invocation: str) -> None:
    m = result["machine"]
    lines = [
        "# Scale: partition time, peak memory, round time, per-client state",
        "",
        f"Produced by `{invocation}`"
        + (" **(SMOKE RUN: tiny sizes, not a measurement)**" if result.get("smoke") else "")
        + ".",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}; "
        f"Python {m['python']}; child processes with OMP_NUM_THREADS={result['threads']}",
        f"- Data: {result['dataset']} training labels / images; model {result['model']}",
        "",
    ]
    if "partition" in result:
        p = result["partition"]
        lines += [
            "## Partition time",
            "",
            f"`make_partition` on {p['labels']:,} labels, in-process `time.perf_counter`, "
            f"best and median of {p['repeat']} calls after one untimed call. Goal: under 5 s "
            "at 10,000 clients.",
            "",
            "| clients | scheme | parameters | best (s) | median (s) | client sizes | call |",
            "|---:|---|---|---:|---:|---|---|",
        ]
        for r in p["rows"]:
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
            if "infeasible" in r:
                lines.append(
                    f"| {r['clients']:,} | {r['scheme']} | {params} | infeasible | | "
                    f"{r['infeasible']} | `{r['call']}` |"
                )
            else:
                lines.append(
                    f"| {r['clients']:,} | {r['scheme']} | {params} | {r['best_s']:.4f} | "
                    f"{r['median_s']:.4f} | {r['min_client']}..{r['max_client']} | "
                    f"`{r['call']}` |"
                )
        lines.append("")
    if "memory" in result:
        mem = result["memory"]
        f = mem["floor"]
        lines += [
            "## Peak memory and round time",
            "",
            "One child process per line; peak RSS = the child's high-water mark (`os.wait4`, "
            "exact; the largest single process); tree PSS = the summed proportional set size "
            "of the child and its descendants (worker processes; shared pages counted once), "
            "sampled every 0.1 s. Round time: "
            "median of metrics.jsonl `seconds` over rounds 2..R (evaluation excluded). "
            "Clients are smaller the more there are, so compare seconds per 1,000 samples and "
            "per sampled client, not seconds per round. Goal: FedAvg peak under 2 GiB at "
            "10,000 clients; time per client and per sample not growing with the total.",
            "",
            f"Floor (`{f['command']}`): **{f['peak_rss_mib']} MiB**.",
            "",
            "| algorithm | clients | per round | peak RSS (MiB) | tree PSS (MiB) | round (s) "
            "| samples / round | s / 1,000 samples | ms / client | wall (s) | command |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in mem["rows"]:
            if r["rc"] != 0:
                lines.append(
                    f"| {r['algorithm']} | {r['clients']:,} | {r['per_round']} | failed "
                    f"(exit {r['rc']}, see {r.get('log')}) | | | | | | | `{r['command']}` |"
                )
                continue
            lines.append(
                f"| {r['algorithm']} | {r['clients']:,} | {r['per_round']} | "
                f"{r['peak_rss_mib']:,} | {r['tree_pss_mib']:,} | "
                f"{r.get('round_s', float('nan')):.3f} | "
                f"{r.get('samples_per_round', 0):,.0f} | {r.get('s_per_1000_samples') or 0:.3f} "
                f"| {r.get('ms_per_client', 0):.1f} | {r['wall_s']:.1f} | `{r['command']}` |"
            )
        lines.append("")
    if "state" in result:
        st = result["state"]
        lines += [
            "## Per-client state",
            "",
            f"Every algorithm on {st['clients']:,} clients, {st['per_round']} per round, "
            f"{st['rounds']} rounds, E = {st['epochs']}, checkpoint after every round, read "
            "back with "
            "`load_checkpoint`; bytes = `ClientState.nbytes()` (tensor bytes + 8 per scalar). "
            "'Bytes per client' is the largest state any client held after any round; state "
            "exists only for clients that were sampled (the engine creates it on a client's "
            "first message), so N clients cost at most N x that. Run in-process through the "
            "CLI's parser (the command shown, plus a per-round callback that reads the "
            "checkpoint).",
            "",
            "| algorithm | bytes / client | x model | entries (bytes, most one client held) "
            "| clients with state / sampled (last round) | projected, 10,000 clients (MiB) "
            "| server per-client entries | command |",
            "|---|---:|---:|---|---|---:|---|---|",
        ]
        for r in st["rows"]:
            last = r["per_round"][-1] if r["per_round"] else {}
            entries = ", ".join(f"{g} ({b:,} B)" for g, b in r.get("entries", {}).items()) or "-"
            server = (
                ", ".join(
                    f"{k}: {v['bytes_per_client']:,.0f} B x {v['clients']}"
                    for k, v in r.get("server_per_client", {}).items()
                )
                or "-"
            )
            if "error" in r:
                entries += f" ERROR: {r['error']}"
            lines.append(
                f"| {r['algorithm']} | {r.get('bytes_per_client', 0):,} | "
                f"{r.get('per_client_vs_model') or 0:.3f} | {entries} | "
                f"{last.get('clients_with_state', 0)} / {last.get('sampled_so_far', 0)} | "
                f"{r.get('projected_10000_mib', 0):,.1f} | {server} | `{r['command']}` |"
            )
        lines += [
            "",
            "Model bytes (global_arrays) per algorithm are in scale.json (`model_bytes`); "
            "the per-round growth of the state is there too (`per_round`).",
            "",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts", type=names, default=["partition", "memory", "state"], help="comma list"
    )
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--model", default="simple-cnn")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="OMP_NUM_THREADS (default: cores)"
    )
    ap.add_argument("--partition-clients", type=ints, default=[1000, 10000], help="comma list")
    ap.add_argument("--partition-repeat", type=int, default=5)
    ap.add_argument(
        "--clients", type=ints, default=[20, 1000, 10000], help="memory runs (comma list)"
    )
    ap.add_argument("--memory-algorithms", type=names, default=["fedavg"], help="comma list")
    ap.add_argument("--per-round", type=int, default=10, help="clients per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each memory run")
    ap.add_argument("--min-size", type=int, default=1, help="dirichlet min_size of the runs")
    ap.add_argument("--state-clients", type=int, default=1000, help="clients of the state runs")
    ap.add_argument("--state-rounds", type=int, default=4)
    ap.add_argument("--state-epochs", type=int, default=2, help="2: FedCME's exchange needs E >= 2")
    ap.add_argument(
        "--state-algorithms", type=names, default=None, help="default: every registered one"
    )
    ap.add_argument(
        "--run-args",
        default="",
        help="more `fedskew run` options for every run, e.g. '--workers 2'",
    )
    ap.add_argument("--smoke", action="store_true", help="label the report as a smoke run")
    ap.add_argument("--out", default=str(RESULTS / "scale.md"))
    args = ap.parse_args()

    out = Path(args.out).resolve()
    os.chdir(REPO)  # run folders and the printed commands are relative to the repository
    invocation = "python benchmarks/scale.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result: dict[str, Any] = {
        "machine": machine_facts(),
        "invocation": invocation.strip(),
        "smoke": args.smoke,
        "threads": args.threads,
        "dataset": args.dataset,
        "model": args.model,
    }
    WORK.mkdir(parents=True, exist_ok=True)
    if "partition" in args.parts:
        result["partition"] = part_partition(args)
    if "memory" in args.parts:
        result["memory"] = part_memory(args)
    if "state" in args.parts:
        result["state"] = part_state(args)
    report(result, out, invocation.strip())


if __name__ == "__main__":
    main()
