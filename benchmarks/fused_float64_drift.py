"""How far float64 rounding alone moves training of ResNet-18 with BatchNorm, against how far
``--clients-together fused`` is from one client after another (issue 47).

tests/test_fused.py holds the fused model to 1e-10 of one after another in float64. MOON and
FedAvg on ResNet-18 with BatchNorm at lr 0.05 land 1e-8 to 1e-6 apart over three rounds.
This script tells a discrepancy of the fused model from rounding that training amplifies:
besides the fused run it trains one after another twice more, each time changing only the
rounding:

* ``reversed rows``: each batch's rows in reverse order (``ClientData.batch``). The same
  function of the same samples: BatchNorm's statistics, the mean loss and every weight
  gradient sum the same terms in another order;
* ``nudged``: the initial weights times 1 + s * 2**-52, s a random sign per element (one unit
  in the last place of float64).

Rounding differences grow with the number of steps and with the learning rate; an error of
the fused model (a BatchNorm buffer updated twice or not at all, a frozen model normalising
by its batch) would show in the first round whatever the learning rate.

The experiment is test_together's: the embedded digits (8x8), 6 clients, 4 a round, 2 local
epochs, batch 16, momentum 0.9, weight decay 1e-3, every tensor in float64, seed 0;
ResNet-18 of width 8 with BatchNorm, which these 8x8 images leave 1x1 in its last stage
(BatchNorm's statistics there are over a batch's 16 or fewer values). Each cell is the
largest absolute difference from one after another over the global model and every client's
state (MOON's previous models) after that round.

    python benchmarks/fused_float64_drift.py [--algorithms moon fedavg] [--lrs 0.01 0.02 0.05]
        [--modes fused] [--rounds 3]

About 4 minutes on 2 cores as committed (``--modes fused vmap`` adds about a minute per
setting with MOON: vmap computes BatchNorm from its formula).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402

from fedskew.assembly.prepare import new_model, prepare  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.device import ExecutionSettings, settings_applied  # noqa: E402
from fedskew.data.federated import ClientData  # noqa: E402
from fedskew.engines.inprocess import InProcessEngine  # noqa: E402
from fedskew.runs.loop import RunState, play_round, server_setup  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARAMS = {"moon": {"mu": 1.0, "out_dim": 16}, "fedavg": {}, "fedprox": {"mu": 0.1}}
HARMLESS = ("reversed rows", "nudged")


@contextlib.contextmanager
def _reversed_rows(on: bool) -> Iterator[None]:
    """Each batch's rows in reverse order while the block runs (when ``on``)."""
    real = ClientData.batch
    if on:
        ClientData.batch = lambda self, rows: real(self, rows.flip(0))  # type: ignore[method-assign]
    try:
        yield
    finally:
        ClientData.batch = real  # type: ignore[method-assign]


def _nudge(model: torch.nn.Module, seed: int) -> None:
    """Every floating-point weight and buffer times 1 + s * 2**-52, s = +-1 at random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                sign = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype) * 2 - 1
                t.mul_(1 + sign * 2.0**-52)


def _states(state: RunState) -> dict[str, torch.Tensor]:
    """The global model and every client's state, by name."""
    out = {"global/" + k: v.clone() for k, v in state.server.global_arrays.items()}
    for cid, client in state.engine.client_states.items():
        out.update({f"client{cid}/{k}": v.clone() for k, v in client.arrays.items()})
    return out


def run(algorithm: str, lr: float, rounds: int, variant: str) -> list[dict[str, torch.Tensor]]:
    """Each round's states of one run: ``variant`` is a --clients-together mode, or one
    after another with a harmless change (HARMLESS)."""
    mode = variant if variant not in HARMLESS else "off"
    cfg = ExperimentConfig(
        algorithm=algorithm, params=PARAMS[algorithm], model="resnet18",
        model_options={"width": 8}, rounds=rounds, num_clients=6, clients_per_round=4,
        local_epochs=2, batch_size=16, lr=lr, momentum=0.9, weight_decay=1e-3, workers=0,
        quiet=True, clients_together=mode, device="cpu",
    )  # fmt: skip
    prep = prepare(cfg)
    prep.fed.x = prep.fed.x.double()
    prep.test = (prep.x_test.double(), prep.y_test)
    model, eval_model = new_model(prep).double(), new_model(prep).double()
    if variant == "nudged":
        _nudge(model, seed=1)
    setup = server_setup(prep, model)
    server = prep.algorithm.Server(prep.params, setup)
    engine = InProcessEngine.from_prepared(prep, prep.algorithm.Client(prep.params), model)
    state = RunState(prep, setup, server, engine, eval_model, cfg.per_round())
    out = []
    with (
        settings_applied(ExecutionSettings(tf32=False, deterministic=False)),
        _reversed_rows(variant == "reversed rows"),
    ):
        for rnd in range(rounds):
            play_round(state, rnd)
            out.append(_states(state))
    return out


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(
        float((b[k] - a[k]).abs().max()) if a[k].is_floating_point() else
        (0.0 if torch.equal(a[k], b[k]) else float("inf"))  # batch counters: equal or not
        for k in a
    )  # fmt: skip


def report(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    lines = [
        "# Float64 drift of fused training against rounding alone (ResNet-18, BatchNorm)",
        "",
        f"Produced by `{result['command']}` on {result['machine_line']}; "
        f"1-minute load average {result['load_before']} before, {result['load_after']} after.",
        "",
        "Largest absolute difference from one after another (global model and every client's "
        "state, float64) after each round. `reversed rows` and `nudged` are one after another "
        "again with only the rounding changed (each batch's rows reversed; initial weights "
        "nudged by one unit in the last place). `fused / rounding` is the fused run's last-round "
        "difference over the larger of the two (`vmap / rounding` the same for vmap).",
        "",
        "| algorithm | lr | run | " + " | ".join(f"round {r + 1}" for r in range(rounds)) + " |",
        "|---|---|---|" + "---|" * rounds,
    ]
    for row in result["rows"]:
        cells = " | ".join(f"{g:.1e}" for g in row["gaps"])
        lines.append(f"| {row['algorithm']} | {row['lr']} | {row['run']} | {cells} |")
    modes = result["modes"]
    lines += [
        "",
        "| algorithm | lr | " + " | ".join(f"{m} / rounding" for m in modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for s in result["settings"]:
        cells = " | ".join(f"{s['over_rounding'][m]:.2f}" for m in modes)
        lines.append(f"| {s['algorithm']} | {s['lr']} | {cells} |")
    lines.append("")
    for m in modes:
        worst = max(s["over_rounding"][m] for s in result["settings"])
        lines.append(
            f"Over these settings {m} is at most {worst:.2f} times as far from one after "
            "another as one after another is from itself under a harmless change of rounding."
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=["moon", "fedavg"], choices=PARAMS)
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.01, 0.02, 0.05])
    parser.add_argument("--modes", nargs="+", default=["fused"], choices=["fused", "vmap"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "fused_float64_drift.md")
    args = parser.parse_args()
    before, started = load1(), time.time()
    rows, settings = [], []
    for algorithm in args.algorithms:
        for lr in args.lrs:
            reference = run(algorithm, lr, args.rounds, "off")
            gaps = {}
            for variant in (*HARMLESS, *args.modes):
                states = run(algorithm, lr, args.rounds, variant)
                gaps[variant] = [_gap(a, b) for a, b in zip(reference, states, strict=True)]
                rows.append({"algorithm": algorithm, "lr": lr, "run": variant,
                             "gaps": gaps[variant]})  # fmt: skip
                print(f"{algorithm} lr={lr} {variant}:", *(f"{g:.1e}" for g in gaps[variant]))
            rounding = max(gaps[v][-1] for v in HARMLESS)
            over = {m: gaps[m][-1] / rounding for m in args.modes}
            settings.append({"algorithm": algorithm, "lr": lr, "over_rounding": over})
    facts = machine_facts()
    result = {
        "command": "python benchmarks/fused_float64_drift.py " + " ".join(sys.argv[1:]),
        "machine": facts,
        "machine_line": f"{facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, "
        f"{facts['torch_threads']} torch thread(s)",
        "load_before": before,
        "load_after": load1(),
        "seconds": round(time.time() - started),
        "rounds": args.rounds,
        "modes": args.modes,
        "rows": rows,
        "settings": settings,
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(result))
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
