"""FedACD: each mechanism pinned against numbers computed here by hand, plus CLI runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fedskew.algorithms.fedacd import (
    LOG_DELTA,
    MIX,
    PARTNER,
    FedACD,
    FedACDClient,
    FedACDParams,
    FedACDServer,
    Mixup,
    adaptability_divergence,
    add_to_confusion,
    aggregation_weights,
    capped_weights,
    confusion_of,
    empty_confusion,
    flat_kl,
    flat_target,
    log_margins,
    soft_confusion,
    template_matrix_q,
)
from fedskew.algorithms.fedavg import FedAvgClient
from fedskew.apps.cli import main
from fedskew.core.errors import UsageError
from fedskew.core.rng import torch_rng
from fedskew.data.federated import ClientData
from fedskew.models import BodyHeadModel, build_model
from fedskew.training.interface import ClientContext, LocalTrainConfig, ServerSetup
from fedskew.training.local import LossFn, get_arrays
from fedskew.training.protocol import ClientState, Message

# --- helpers written for the tests, independent of the implementation ---------------------


def softmax_row(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    s = sum(e)
    return [v / s for v in e]


def ce(logits: list[float], y: int) -> float:
    return -math.log(softmax_row(logits)[y])


def flat_kl_by_hand(logits: list[float], y: int) -> float:
    p = softmax_row(logits)
    c = len(p)
    q_other = (1 - p[y]) / (c - 1)
    return sum(q_other * math.log(q_other / p[k]) for k in range(c) if k != y)


def identity_model(num_classes: int, dropout: float = 0.0) -> BodyHeadModel:
    """Logits = inputs, so the test chooses the model's outputs (dropout only in train mode)."""
    return BodyHeadModel(nn.Dropout(dropout), nn.Identity(), num_classes)


def loss_params(**kw: object) -> FedACDParams:
    return FedACD.make_params(kw)


def close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def acd_loss_fn(
    params: FedACDParams,
    start: tuple[torch.Tensor, torch.Tensor] | None = None,
    steps: dict[str, torch.Tensor] | None = None,
    batches_per_epoch: int = 100,
) -> LossFn:
    """One client's loss as run_plain gives it to train_client: FedACD's plan for 3 classes
    from ``start`` and the step draws ``steps``, epochs of ``batches_per_epoch`` batches."""
    plan = FedACDClient(params).plan(lambda result: Message("trained"), 3, start, steps or {})
    return plan.loss_fn(batches_per_epoch)


# --- the soft confusion matrix ------------------------------------------------------------


def test_soft_confusion_is_the_class_mean_softmax_in_eval_mode():
    logits = [
        [2.0, 0.0, -1.0],
        [1.0, 1.0, 0.0],
        [0.0, 3.0, 0.5],
        [9.0, 9.0, 9.0],  # not this client's
        [-1.0, 2.0, 0.0],
        [0.5, 0.0, 0.0],
        [0.0, 0.0, 4.0],
    ]
    labels = [0, 0, 1, 2, 1, 0, 1]
    rows = [0, 1, 2, 4, 5, 6]  # class 2 is missing on this client
    data = ClientData(torch.tensor(logits), torch.tensor(labels), torch.tensor(rows), num_classes=3)
    # Heavy dropout: a train-mode pass would zero or scale the logits and change P.
    model = identity_model(3, dropout=0.9).train()
    confusion, counts = soft_confusion(model, data, 3, batch_size=4)  # crosses a batch edge
    assert model.training  # mode restored
    for cls in range(3):
        mine = [softmax_row(logits[r]) for r in rows if labels[r] == cls]
        n = len(mine)
        assert counts[cls].item() == n
        for j in range(3):
            expected = sum(p[j] for p in mine) / (n + 1e-8) if n else 0.0
            assert close(confusion[cls, j].item(), expected)


def test_accumulator_splits_a_mixed_sample_between_its_two_labels():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    mixed = {
        "probs": probs, "y_a": torch.tensor([0, 1]), "y_b": torch.tensor([1, 2]),
        "mix": torch.tensor(0.75, dtype=torch.float64),
    }  # fmt: skip
    confusion, weights = confusion_of(add_to_confusion(empty_confusion(3, "cpu"), mixed))
    assert weights.tolist() == [0.75, 1.0, 0.25]
    row0 = [0.75 * v for v in (0.5, 0.3, 0.2)]
    row1 = [0.25 * a + 0.75 * b for a, b in zip((0.5, 0.3, 0.2), (0.1, 0.1, 0.8), strict=True)]
    row2 = [0.25 * v for v in (0.1, 0.1, 0.8)]
    for i, (row, w) in enumerate(zip((row0, row1, row2), (0.75, 1.0, 0.25), strict=True)):
        for j in range(3):
            assert close(confusion[i, j].item(), row[j] / (w + 1e-8))


# --- the flattening term ------------------------------------------------------------------


def test_flat_target_and_kl_by_hand():
    p = [0.1, 0.6, 0.2, 0.1]
    logits = torch.tensor([[math.log(v) for v in p], [0.0, 1.0, -2.0, 3.0]], requires_grad=True)
    y = torch.tensor([1, 3])
    q = flat_target(torch.softmax(logits.detach(), 1), y)
    rest = 0.4 / 3
    assert torch.allclose(q[0], torch.tensor([rest, 0.6, rest, rest]), atol=1e-6)
    by_hand = 2 * rest * math.log(rest / 0.1) + rest * math.log(rest / 0.2)
    kl = flat_kl(logits, y)
    assert close(kl[0].item(), by_hand, 1e-5)
    assert close(kl[1].item(), flat_kl_by_hand([0.0, 1.0, -2.0, 3.0], 3), 1e-5)
    # The target is a constant: the gradient on the logits is p - q, zero on the true class,
    # so the term moves only the non-true mass.
    kl.sum().backward()
    grad = logits.grad
    assert torch.allclose(grad, torch.softmax(logits.detach(), 1) - q, atol=1e-6)
    assert abs(grad[0, 1].item()) < 1e-6 and abs(grad[1, 3].item()) < 1e-6


def test_reverse_flat_kl_by_hand():
    p = [0.1, 0.6, 0.2, 0.1]
    rest = 0.4 / 3
    by_hand = sum(pk * math.log(pk / rest) for k, pk in enumerate(p) if k != 1)
    kl = flat_kl(torch.tensor([[math.log(v) for v in p]]), torch.tensor([1]), direction="pq")
    assert close(kl.item(), by_hand, 1e-5)


def test_loss_is_ce_plus_lam_times_flat_and_plain_ce_when_both_off():
    x = torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.3, 2.0]])
    y = torch.tensor([0, 1])
    rows = x.tolist()
    model = identity_model(3)
    ce_mean = sum(ce(r, int(c)) for r, c in zip(rows, y.tolist(), strict=True)) / 2
    flat_mean = sum(flat_kl_by_hand(r, int(c)) for r, c in zip(rows, y.tolist(), strict=True)) / 2
    full = acd_loss_fn(loss_params(margin=False, mixup=False, lam=1.5))
    out = full(model, x, y)
    assert close(out.loss.item(), ce_mean + 1.5 * flat_mean, 1e-5)
    assert torch.equal(out.logits, x) and torch.equal(out.features, x)
    plain = acd_loss_fn(loss_params(margin=False, mixup=False, lam=0.0))
    assert close(plain(model, x, y).loss.item(), ce_mean, 1e-5)


# --- the adaptive logit margins -----------------------------------------------------------


def test_log_margins_missing_class_and_clipping():
    delta = 1e-3
    confusion = torch.tensor(
        [
            [0.7, 0.2, 0.05, 0.05],
            [0.1, 0.8, 0.05, 0.05],
            [0.5, 1e-5, 0.4, 0.09999],
            [0.0, 0.0, 0.0, 0.0],  # class 3 missing
        ],
        dtype=torch.float64,
    )
    present = torch.tensor([True, True, True, False])
    table = log_margins(confusion, present, delta)
    expected = {
        (0, 1): math.log(0.2 / (0.1 + 1e-8)),
        (1, 0): math.log(0.1 / (0.2 + 1e-8)),
        (0, 2): math.log(0.05 / (0.5 + 1e-8)),
        (2, 0): math.log(0.5 / (0.05 + 1e-8)),
        (1, 2): -math.log(delta),  # log(0.05 / 1e-5) = log 5000 is clipped down
        (2, 1): math.log(delta),  # log(1e-5 / 0.05) = log 2e-4 is clipped up
        (0, 3): math.log(delta),  # partner class missing: Delta = delta
        (1, 3): math.log(delta),
        (2, 3): math.log(delta),
    }
    for i in range(4):
        for j in range(4):
            want = expected.get((i, j), 0.0)  # diagonal and the unused missing row: 0
            assert close(table[i, j].item(), want, 1e-6), (i, j)


def test_margin_loss_is_the_pairwise_logit_adjusted_ce():
    delta = 1e-3
    confusion = torch.tensor(
        [[0.6, 0.3, 0.1], [0.1, 0.85, 0.05], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    weights = torch.tensor([4.0, 5.0, 0.0])  # class 2 missing
    log_delta = [
        [0.0, math.log(0.3 / 0.1), math.log(delta)],
        [math.log(0.1 / 0.3), 0.0, math.log(delta)],
    ]
    x = torch.tensor([[1.0, 0.5, 2.0], [0.3, -0.2, 0.1], [0.0, 1.0, 1.0]])
    y = [0, 1, 1]
    fn = acd_loss_fn(loss_params(mixup=False, lam=0.0), (confusion, weights))
    out = fn(identity_model(3), x, torch.tensor(y))
    f = x.tolist()
    by_hand = [
        math.log(1 + sum(math.exp(f[n][i] - f[n][c] + log_delta[c][i]) for i in range(3) if i != c))
        for n, c in enumerate(y)
    ]
    assert close(out.loss.item(), sum(by_hand) / 3, 1e-5)
    # Delta is a constant: the gradient is that of CE on the shifted logits, nothing else.
    xg = x.clone().requires_grad_(True)
    fn(identity_model(3), xg, torch.tensor(y)).loss.backward()
    shifted = torch.tensor([[f[n][i] + log_delta[c][i] for i in range(3)] for n, c in enumerate(y)])
    want = (torch.softmax(shifted, 1) - nn.functional.one_hot(torch.tensor(y), 3)) / 3
    assert torch.allclose(xg.grad, want, atol=1e-6)


def test_mixup_loss_and_its_contribution_to_the_next_epochs_margins():
    # A symmetric start matrix with every class present: all margins start at 0.
    start = torch.full((3, 3), 0.2, dtype=torch.float64).fill_diagonal_(0.6)
    x = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [1.0, -1.0, 3.0]])
    y = [0, 1, 2]
    perm = [2, 0, 1]
    mix = 0.7
    # Fixed mixing draws for both steps, so the test knows what the loss mixed; an epoch of
    # two batches of 3.
    steps = {
        MIX: torch.tensor([mix, mix], dtype=torch.float64),
        PARTNER: torch.tensor([perm, perm]),
    }
    fn = acd_loss_fn(loss_params(), (start, torch.ones(3)), steps, batches_per_epoch=2)
    out = fn(identity_model(3), x, torch.tensor(y))

    xs = x.tolist()
    mixed = [[mix * xs[n][j] + (1 - mix) * xs[perm[n]][j] for j in range(3)] for n in range(3)]
    y_b = [y[perm[n]] for n in range(3)]
    by_hand = sum(
        mix * (ce(m, a) + flat_kl_by_hand(m, a)) + (1 - mix) * (ce(m, b) + flat_kl_by_hand(m, b))
        for m, a, b in zip(mixed, y, y_b, strict=True)
    )
    assert close(out.loss.item(), by_hand / 3, 1e-5)
    assert torch.allclose(out.logits, torch.tensor(mixed), atol=1e-6)

    # Half an epoch seen: the margins still come from the (symmetric) start matrix.
    zeros = torch.zeros(3, 3, dtype=torch.float64)
    assert torch.allclose(fn.carried[LOG_DELTA], zeros, atol=1e-6)
    fn(identity_model(3), x, torch.tensor(y))
    # A full epoch (6 samples, the same batch twice): the margins now come from the mixed
    # outputs, each one counted with weight mix on row y_a and 1 - mix on row y_b.
    sums = [[0.0] * 3 for _ in range(3)]
    weights = [0.0] * 3
    for m, a, b in zip(mixed, y, y_b, strict=True):
        p = softmax_row(m)
        for row, w in ((a, mix), (b, 1 - mix)):
            weights[row] += 2 * w
            for j in range(3):
                sums[row][j] += 2 * w * p[j]
    confusion = [[sums[i][j] / (weights[i] + 1e-8) for j in range(3)] for i in range(3)]
    for i in range(3):
        for j in range(3):
            want = 0.0 if i == j else math.log(confusion[i][j] / (confusion[j][i] + 1e-8))
            assert close(fn.carried[LOG_DELTA][i, j].item(), want, 1e-6), (i, j)


def test_mixup_draws_are_beta_and_addressed():
    a = Mixup(1.0, torch_rng(0, 3, 5, "fedacd-mixup"))
    b = Mixup(1.0, torch_rng(0, 3, 5, "fedacd-mixup"))
    first, second = a.draw(6), b.draw(6)
    assert first[0] == second[0] and torch.equal(first[1], second[1])
    assert sorted(first[1].tolist()) == list(range(6))
    # The round's draws at once (one copy to the device) are the batches' draws in order,
    # epoch after epoch, each permutation zero-padded to the largest batch.
    sizes = [4, 4, 3]
    whole = Mixup(1.0, torch_rng(0, 3, 5, "fedacd-mixup"), sizes)
    single = Mixup(1.0, torch_rng(0, 3, 5, "fedacd-mixup"))
    mixes, partners = whole.draw_steps(2, torch.device("cpu"))
    assert mixes.dtype == torch.float64 and partners.shape == (6, 4)
    for step, n in enumerate(sizes * 2):
        want_mix, want_perm = single.draw(n)
        assert mixes[step].item() == want_mix and torch.equal(partners[step, :n], want_perm)
        assert not partners[step, n:].any()
    for alpha in (1.0, 0.2):
        m = Mixup(alpha, torch_rng(1, 0, 0, "fedacd-mixup"))
        draws = torch.tensor([m.draw(2)[0] for _ in range(4000)], dtype=torch.float64)
        assert 0 <= draws.min() and draws.max() <= 1
        # Beta(alpha, alpha): mean 1/2, variance 1 / (4 (2 alpha + 1)).
        assert abs(draws.mean().item() - 0.5) < 0.03
        assert abs(draws.var().item() / (1 / (4 * (2 * alpha + 1))) - 1) < 0.1


# --- the score and the weights ------------------------------------------------------------


def test_template_matrix_q_and_divergence_by_hand():
    q = template_matrix_q(10, 1 - 1e-5)
    assert close(q[3, 3].item(), 1 - 1e-5) and close(q[3, 4].item(), 1e-5 / 9)
    assert torch.allclose(q.sum(1), torch.ones(10, dtype=torch.float64))

    tau = 0.9  # Q = [[0.9, 0.05, 0.05], ...]
    confusion = torch.tensor([[0.8, 0.1, 0.1], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    present = torch.tensor([True, True, False])
    kl0 = 0.8 * math.log(0.8 / 0.9) + 2 * 0.1 * math.log(0.1 / 0.05)
    kl1 = 1.0 * math.log(1.0 / 0.05)  # 0 log 0 = 0
    assert close(adaptability_divergence(confusion, present, tau), (kl0 + kl1) / 2)
    assert close(adaptability_divergence(confusion, present, tau, rows="sum"), kl0 + kl1)


def test_weights_inverse_softmax_uniform_by_hand():
    d = [1.0, 2.0, 4.0]
    inv = aggregation_weights(d, "inverse")
    assert all(close(a, b) for a, b in zip(inv, [4 / 7, 2 / 7, 1 / 7], strict=True))
    z = math.exp(-1) + math.exp(-2) + math.exp(-4)
    soft = aggregation_weights(d, "softmax")
    assert all(close(a, math.exp(-v) / z) for a, v in zip(soft, d, strict=True))
    assert aggregation_weights(d, "uniform") == pytest.approx([1 / 3] * 3)


class FakeChannel:
    def __init__(self, replies: dict[int, Message]) -> None:
        self.replies = replies
        self.sent: list[dict[int, Message]] = []

    def exchange(self, messages, expect=None):
        self.sent.append(dict(messages))
        return {c: self.replies[c] for c in messages}


@pytest.mark.parametrize(
    "weighting, alphas",
    [
        ("inverse", [4 / 7, 2 / 7, 1 / 7]),
        ("softmax", [math.exp(-d) / sum(math.exp(-e) for e in (1, 2, 4)) for d in (1, 2, 4)]),
        ("uniform", [1 / 3, 1 / 3, 1 / 3]),
    ],
)
def test_server_aggregates_by_score_not_by_size(weighting, alphas):
    models = {
        3: torch.tensor([1.0, 0.0, 2.0]),
        5: torch.tensor([0.0, 4.0, -2.0]),
        9: torch.tensor([7.0, 1.0, 0.0]),
    }
    divergences = {3: 1.0, 5: 2.0, 9: 4.0}
    replies = {
        c: Message("trained", arrays={"w": w}, scalars={"loss": 0.5, "divergence": divergences[c]})
        for c, w in models.items()
    }
    setup = ServerSetup(
        initial_arrays={"w": torch.zeros(3)},
        num_clients=10,
        num_classes=3,
        client_sizes=[1, 1, 1, 5, 1, 500, 1, 1, 1, 50000],  # ignored by design
        seed=0,
        train=LocalTrainConfig(),
    )
    server = FedACDServer(FedACD.make_params({"weighting": weighting}), setup)
    channel = FakeChannel(replies)
    metrics = server.round(0, [3, 5, 9], channel)
    expected = sum(a * models[c] for a, c in zip(alphas, (3, 5, 9), strict=True))
    assert torch.allclose(server.global_arrays["w"], expected, atol=1e-6)
    assert len(channel.sent) == 1
    down = channel.sent[0][3]
    assert down.kind == "train" and set(down.arrays) == {"w"} and not down.scalars
    assert metrics["train_loss"] == 0.5
    if weighting != "uniform":
        assert close(metrics["divergence"], 7 / 3)
        assert close(metrics["weight_max"], max(alphas))


# --- the client ---------------------------------------------------------------------------


def make_ctx(model: nn.Module, seed: int = 0) -> ClientContext:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(60, 1, 8, 8, generator=gen)
    y = torch.randint(0, 7, (60,), generator=gen)  # classes 7..9 missing
    data = ClientData(x, y, torch.arange(5, 55), num_classes=10)
    return ClientContext(
        client_id=2,
        round=1,
        seed=seed,
        data=data,
        model=model,
        state=ClientState(),
        train=LocalTrainConfig(epochs=2, batch_size=16, lr=0.05),
    )


def test_switches_off_reduce_local_training_to_fedavg():
    model = build_model("mlp", (1, 8, 8), 10)
    start = get_arrays(model)
    msg = Message("train", arrays=start)
    ctx = make_ctx(model)
    avg = FedAvgClient(None).handle(msg, ctx).arrays
    off = FedACD.make_params({"lam": 0, "margin": False, "mixup": False, "weighting": "uniform"})
    acd_off = FedACDClient(off).handle(msg, make_ctx(model))
    assert set(acd_off.scalars) == {"loss"}
    assert all(torch.equal(avg[k], acd_off.arrays[k]) for k in avg)
    acd = FedACDClient(FedACD.make_params({})).handle(msg, make_ctx(model))
    assert not all(torch.equal(avg[k], acd.arrays[k]) for k in avg)


def test_client_scores_its_final_model():
    model = build_model("mlp", (1, 8, 8), 10)
    ctx = make_ctx(model)
    reply = FedACDClient(FedACD.make_params({})).handle(
        Message("train", arrays=get_arrays(model)), ctx
    )
    assert set(reply.scalars) == {"loss", "divergence"}
    assert not ctx.state.arrays and not ctx.state.scalars  # nothing kept between rounds
    trained = build_model("mlp", (1, 8, 8), 10)
    trained.load_state_dict(reply.arrays)
    trained.eval()
    x, y = ctx.data.batch(torch.arange(len(ctx.data)))
    with torch.no_grad():
        p = torch.softmax(trained(x), 1).double()
    tau = 1 - 1e-5
    off = (1 - tau) / 9
    kls = []
    for c in range(7):
        row = p[y == c].mean(0)
        kls.append(
            sum(
                float(v) * math.log(float(v) / (tau if j == c else off))
                for j, v in enumerate(row)
                if v > 0
            )
        )
    assert close(reply.scalars["divergence"], sum(kls) / len(kls), 1e-5)


def test_params_parse_and_reject_bad_values():
    p = FedACD.make_params(
        {"margin": "false", "mixup": "off", "weighting": "softmax", "lam": "0.5"}
    )
    assert (p.margin, p.mixup, p.weighting, p.lam) == (False, False, "softmax", 0.5)
    d = FedACD.make_params({})
    assert (d.lam, d.margin, d.delta, d.mixup, d.mixup_alpha, d.tau, d.weighting) == (
        1.0,
        True,
        1e-3,
        True,
        1.0,
        1 - 1e-5,
        "inverse",
    )
    for bad in (
        {"weighting": "size"},
        {"delta": "0"},
        {"delta": "1"},
        {"mixup_alpha": "0"},
        {"tau": "1"},
        {"lam": "-1"},
        {"flat_kl": "both"},
        {"score_rows": "max"},
    ):
        with pytest.raises(UsageError):
            FedACD.make_params(bad)


# --- end to end through the CLI -----------------------------------------------------------

FAST = ["--rounds", "3", "--local-epochs", "1", "-q"]


def run_cli(tmp_path: Path, name: str, *args: str) -> list[dict]:
    assert main(["run", "-o", str(tmp_path), "--name", name, *FAST, *args]) == 0
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_three_scored_rounds(records: list[dict]) -> None:
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1 for r in records)


# The defaults and weighting=uniform (FedACD_base) run in the byte-count test below.
@pytest.mark.parametrize(
    "switch",
    ["lam=0", "margin=false", "mixup=false", "weighting=softmax", "flat_kl=pq", "score_rows=sum"],
)
def test_cli_runs_each_ablation(tmp_path, switch):
    assert_three_scored_rounds(run_cli(tmp_path, "r", "-a", "fedacd", "-p", switch))


def test_bytes_per_round_are_the_model_each_way_plus_the_scalars(tmp_path):
    model = build_model("mlp", (1, 8, 8), 10)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_round = 8  # 40 % of 20 clients
    fedacd = run_cli(tmp_path, "acd", "-a", "fedacd")
    base = run_cli(tmp_path, "base", "-a", "fedacd", "-p", "weighting=uniform")
    fedavg = run_cli(tmp_path, "avg", "-a", "fedavg")
    assert_three_scored_rounds(fedacd)
    assert_three_scored_rounds(base)
    for acd, uni, avg in zip(fedacd, base, fedavg, strict=True):
        assert acd["bytes_down"] == uni["bytes_down"] == avg["bytes_down"]
        assert acd["bytes_down"] == per_round * model_bytes
        # Up: the model, the training loss and the score D (8 bytes each). FedAvg's sample
        # count is not sent: FedACD's weights do not use it.
        assert acd["bytes_up"] == per_round * (model_bytes + 2 * 8)
        assert uni["bytes_up"] == per_round * (model_bytes + 8)  # FedACD_base sends no score
        assert acd["bytes_up"] - uni["bytes_up"] == per_round * 8
        assert avg["bytes_up"] == per_round * (model_bytes + 2 * 8)


def test_capped_weights_bound_a_client_that_claims_no_divergence():
    """A client claiming D = 0 owns the inverse-weighted average; max_weight bounds it and
    hands the excess to the others in proportion, summing to 1."""
    raw = aggregation_weights([0.0, 2.0, 4.0], "inverse")
    assert raw[0] > 0.999
    capped = capped_weights(raw, 0.5)
    assert capped[0] == pytest.approx(0.5)
    assert capped[1] / capped[2] == pytest.approx(raw[1] / raw[2])
    assert sum(capped) == pytest.approx(1.0)
    assert capped_weights([0.2, 0.3, 0.5], 1.0) == [0.2, 0.3, 0.5]  # no cap: the paper's
    assert capped_weights([0.9, 0.1], 0.2) == pytest.approx([0.5, 0.5])  # 2 x 0.2 < 1
    with pytest.raises(UsageError, match="max_weight"):
        FedACDParams(max_weight=0.0).validate()
