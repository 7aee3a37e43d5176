"""Protocol, addressed randomness, aggregation and the local-training loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedskew.algorithms import fedavg
from fedskew.algorithms.fedavg import FedAvg
from fedskew.config import ExperimentConfig
from fedskew.core.errors import FedskewError, UsageError
from fedskew.core.rng import derive_seed, numpy_rng, torch_rng
from fedskew.data.federated import ClientData, gather_rows, sample_clients
from fedskew.models import BodyHeadModel
from fedskew.runs.loop import run
from fedskew.training.aggregation import apply_server_lr, weighted_average
from fedskew.training.interface import LocalTrainConfig
from fedskew.training.local import local_train
from fedskew.training.protocol import Message, needs, unmet


def test_message_nbytes_counts_arrays_numbers_and_strings():
    msg = Message(
        "train",
        arrays={"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)},
        scalars={"n": 1.0, "loss": 2.0},
        strings={"peer": "abc"},
    )
    assert msg.nbytes() == 3 * 4 * 4 + 5 * 8 + 2 * 8 + 3


def test_addressed_rng_depends_on_address_not_order():
    a = numpy_rng(7, 3, 5, "train").random(4)
    numpy_rng(7, 3, 6, "train").random(100)  # another client's draws consume nothing of ours
    b = numpy_rng(7, 3, 5, "train").random(4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, numpy_rng(7, 3, 5, "eval").random(4))
    assert not np.array_equal(a, numpy_rng(7, 4, 5, "train").random(4))
    assert not np.array_equal(a, numpy_rng(8, 3, 5, "train").random(4))
    # The same number in every process and Python version (no hash()): resumed runs and
    # worker processes rely on it.
    assert derive_seed(1, 2, 3, "x") == 5892264977675119791
    t1 = torch.randn(3, generator=torch_rng(1, 0, -1, "init"))
    t2 = torch.randn(3, generator=torch_rng(1, 0, -1, "init"))
    assert torch.equal(t1, t2)


def test_client_sampling_is_a_pure_function_of_seed_and_round():
    r5 = sample_clients(3, 5, 100, 10)
    assert r5 == sample_clients(3, 5, 100, 10)
    assert len(set(r5)) == 10 and all(0 <= c < 100 for c in r5)
    assert r5 != sample_clients(3, 6, 100, 10)
    assert sample_clients(3, 0, 4, 8) == [0, 1, 2, 3]


def test_weighted_average_by_hand():
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    s2 = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_average([s1, s2], [1, 3])
    # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; integer buffers keep the largest
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert out["n"].item() == 5
    with pytest.raises(ValueError):
        weighted_average([s1], [0])


def test_server_lr_moves_part_of_the_way():
    old = {"w": torch.tensor([0.0, 10.0])}
    new = {"w": torch.tensor([2.0, 0.0])}
    assert torch.allclose(apply_server_lr(old, new, 0.5)["w"], torch.tensor([1.0, 5.0]))
    assert apply_server_lr(old, new, 1.0)["w"] is new["w"]


class _RecordingChannel:
    """Acts as every client: returns fixed models with given sample counts."""

    def __init__(self, models: dict[int, dict[str, torch.Tensor]], sizes: dict[int, int]):
        self.models, self.sizes, self.sent = models, sizes, []

    def exchange(self, messages, expect=None):
        self.sent.append(messages)
        return {
            c: Message(
                "trained",
                arrays=self.models[c],
                scalars={"num_samples": self.sizes[c], "loss": 0.0},
            )
            for c in messages
        }


def test_fedavg_server_weights_by_sample_count():
    from fedskew.training.interface import ServerSetup

    init = {"w": torch.zeros(2)}
    setup = ServerSetup(
        init,
        num_clients=3,
        num_classes=2,
        client_sizes=[10, 30, 60],
        seed=0,
        train=LocalTrainConfig(),
    )
    server = FedAvg.Server(FedAvg.make_params({}), setup)
    channel = _RecordingChannel(
        {0: {"w": torch.tensor([1.0, 0.0])}, 2: {"w": torch.tensor([0.0, 1.0])}}, {0: 10, 2: 30}
    )
    server.round(0, [0, 2], channel)
    assert list(channel.sent[0]) == [0, 2] and channel.sent[0][0].kind == "train"
    assert torch.allclose(server.global_arrays["w"], torch.tensor([0.25, 0.75]))
    # server lr 0.5: halfway from the old global model
    server2 = FedAvg.Server(FedAvg.make_params({"server_lr": "0.5"}), setup)
    server2.round(0, [0, 2], channel)
    assert torch.allclose(server2.global_arrays["w"], torch.tensor([0.125, 0.375]))


def test_algorithm_params_are_checked():
    with pytest.raises(UsageError, match="no parameter 'mu'"):
        FedAvg.make_params({"mu": 1})
    with pytest.raises(UsageError, match="expects float"):
        FedAvg.make_params({"server_lr": "fast"})
    with pytest.raises(UsageError, match="server_lr"):
        FedAvg.make_params({"server_lr": 0})


def test_local_train_runs_expected_steps_and_learns():
    torch.manual_seed(0)
    x = torch.randn(200, 5)
    y = (x[:, 0] > 0).long()
    data = ClientData(x, y, torch.arange(50, 150), num_classes=2)
    model = BodyHeadModel(torch.nn.Identity(), torch.nn.Linear(5, 2), feature_dim=5)
    cfg = LocalTrainConfig(epochs=3, batch_size=32, lr=0.5, momentum=0.0, weight_decay=0.0)
    before = torch.nn.functional.cross_entropy(model(x[50:150]), y[50:150]).item()
    result = local_train(model, data, cfg, torch_rng(0, 0, 0, "train"))
    after = torch.nn.functional.cross_entropy(model(x[50:150]), y[50:150]).item()
    assert result.steps == 3 * 4  # ceil(100 / 32) batches per epoch, last one partial
    assert result.samples == 300
    assert after < before


def test_unmet_names_what_a_reply_lacks_or_its_wrong_kind():
    expect = {"trained": needs(("w", "b"), ("loss",)), "half": needs()}
    full = Message("trained", arrays={"w": torch.zeros(1), "b": torch.zeros(1)},
                   scalars={"loss": 1.0, "extra": 2.0})  # fmt: skip
    assert unmet(full, expect) is None
    assert unmet(Message("half"), expect) is None
    assert unmet(Message("trained", arrays={"w": torch.zeros(1)}, scalars={"loss": 1.0}),
                 expect) == "lacks the array 'b'"  # fmt: skip
    assert unmet(Message("trained", arrays=dict(full.arrays)), expect) == (
        "lacks the number 'loss'"
    )
    assert unmet(Message("done"), expect) == "is of kind 'done', expected 'half' or 'trained'"


def test_reply_lacking_what_the_server_reads_stops_the_run_naming_the_client(tmp_path, monkeypatch):
    """In one process a client's reply comes from the algorithm's own code: a reply without
    what its server reads is a fault there, reported as such rather than as a KeyError deep
    in the aggregation."""
    honest = fedavg.trained_reply

    def without_count(ctx, loss, arrays=None, scalars=None):
        reply = honest(ctx, loss, arrays, scalars)
        del reply.scalars["num_samples"]
        return reply

    monkeypatch.setattr(fedavg, "trained_reply", without_count)
    cfg = ExperimentConfig(num_clients=4, clients_per_round=2, rounds=1, local_epochs=1,
                           out_dir=str(tmp_path), quiet=True)  # fmt: skip
    with pytest.raises(FedskewError, match=r"round 1: the reply of client \d+ lacks the "
                       r"number 'num_samples', which the algorithm's server reads"):  # fmt: skip
        run(cfg)


def test_local_train_only_sees_its_own_rows():
    x = torch.arange(10, dtype=torch.float32)[:, None]
    y = torch.zeros(10, dtype=torch.long)
    data = ClientData(x, y, torch.tensor([2, 5, 7]), num_classes=1)
    seen = []

    def spy(model, xb, yb):
        seen.extend(xb[:, 0].tolist())
        return model(xb).sum() * 0

    local_train(
        torch.nn.Linear(1, 1),
        data,
        LocalTrainConfig(epochs=2, batch_size=2),
        torch.Generator().manual_seed(0),
        loss_fn=spy,
    )
    assert sorted(seen) == [2.0, 2.0, 5.0, 5.0, 7.0, 7.0]


def test_batch_bounds_cover_everything_and_never_leave_one_sample():
    from fedskew.training.local import batch_bounds

    assert batch_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert batch_bounds(9, 4) == [(0, 4), (4, 9)]
    assert batch_bounds(1, 4) == [(0, 1)]
    assert batch_bounds(8, 4) == [(0, 4), (4, 8)]


def test_extra_loss_terms_see_features_logits_and_labels():
    x = torch.randn(8, 3)
    y = torch.tensor([0, 1] * 4)
    data = ClientData(x, y, torch.arange(8), num_classes=2)
    model = BodyHeadModel(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), feature_dim=4)
    calls = []

    def term(features, logits, labels):
        calls.append((features.shape, logits.shape, labels.tolist()))
        return features.pow(2).mean()

    cfg = LocalTrainConfig(epochs=1, batch_size=8, momentum=0.0)
    local_train(model, data, cfg, torch.Generator().manual_seed(0), extra_terms=[term])
    assert calls == [(torch.Size([8, 4]), torch.Size([8, 2]), calls[0][2])]
    assert sorted(calls[0][2]) == sorted(y.tolist())


def test_class_feature_means_by_hand():
    from fedskew.training.local import class_feature_means

    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0], [7.0, 1.0], [9.0, 9.0]])
    y = torch.tensor([0, 0, 2, 2, 1])
    data = ClientData(x, y, torch.tensor([0, 1, 2, 3]), num_classes=3)  # row 4 not ours
    model = BodyHeadModel(torch.nn.Identity(), torch.nn.Linear(2, 3), feature_dim=2)
    means, counts = class_feature_means(model, data, 3)
    assert counts.tolist() == [2, 0, 2]
    assert torch.allclose(means, torch.tensor([[2.0, 1.0], [0.0, 0.0], [6.0, 3.0]]))


def test_grad_clip_bounds_each_step():
    x = torch.full((4, 3), 100.0)
    y = torch.tensor([0, 1, 0, 1])
    data = ClientData(x, y, torch.arange(4), num_classes=2)
    model = BodyHeadModel(torch.nn.Identity(), torch.nn.Linear(3, 2), feature_dim=3)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = LocalTrainConfig(epochs=1, batch_size=4, lr=1.0, momentum=0.0, weight_decay=0.0,
                           grad_clip=0.5)  # fmt: skip
    local_train(model, data, cfg, torch.Generator().manual_seed(0))
    params = list(model.parameters())
    step = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, params, strict=True)])
    # one SGD step with lr 1 moves the weights by exactly the clipped gradient
    assert abs(float(step.norm()) - 0.5) < 1e-5


@pytest.mark.parametrize(
    "shape", [(9,), (9, 5), (9, 1), (9, 3, 4), (9, 1, 28, 28), (9, 3, 8, 8), (9, 3, 1, 5),
              (9, 3, 5, 1), (9, 64, 1, 1), (9, 1, 1, 1), (9, 2, 3, 4, 5)],
)  # fmt: skip
def test_gather_rows_is_advanced_indexing(shape: tuple[int, ...]) -> None:
    """ClientData.batch gathers with index_select where rows lie whole in memory: the result
    must be x[idx] exactly (values, dtype, shape and strides, so that the layers reading the
    batch pick the same kernels), in every layout, channels_last included."""
    base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    layouts = [base, base.t().contiguous().t()] if base.dim() == 2 else [base]
    if base.dim() == 4:
        layouts += [
            base.contiguous(memory_format=torch.channels_last),
            base.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
            base.transpose(2, 3),  # neither layout: advanced indexing itself
        ]
    for x in layouts:
        for rows in ([4, 0, 8, 8, 1], [2], []):
            idx = torch.tensor(rows, dtype=torch.int64)
            want, got = x[idx], gather_rows(x, idx)
            assert torch.equal(want, got)
            assert (want.dtype, want.shape, want.stride()) == (got.dtype, got.shape, got.stride())
