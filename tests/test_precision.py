"""The precision policy (fp32 / bf16 autocast) in local training, evaluation and the CLI."""

from __future__ import annotations

import gzip
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.fedavg import FedAvg
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.core.precision import PRECISIONS, autocast, check_precision
from fedskew.data.federated import ClientData
from fedskew.metrics.evaluation import evaluate
from fedskew.models import build_model
from fedskew.runs import loop as experiment
from fedskew.runs.loop import run
from fedskew.training.interface import ClientContext, LocalTrainConfig
from fedskew.training.local import LossOutput, get_arrays, local_train, make_optimizer
from fedskew.training.protocol import ClientState, Message

SHAPE = (1, 28, 28)


def separable_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes told apart by the brightness of the upper half: a problem a CNN learns
    in a few steps, so that a falling loss says the loop trains."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, *SHAPE, generator=gen) * 0.5
    x[:, :, :14, :] += (2.0 * y - 1.0).view(n, 1, 1, 1)
    return x, y


def fresh_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("fedavg-cnn", SHAPE, 2)


def train_cfg(precision: str, epochs: int = 2) -> LocalTrainConfig:
    return LocalTrainConfig(
        epochs=epochs, batch_size=16, lr=0.01, momentum=0.9, weight_decay=0.0, precision=precision
    )


def train(precision: str, epochs: int = 2) -> tuple[dict[str, torch.Tensor], float, float]:
    """(trained arrays, loss before, loss after) of fedavg-cnn on 64 separable images."""
    x, y = separable_images(64, seed=1)
    model = fresh_model()
    with torch.no_grad():
        before = float(F.cross_entropy(model(x), y))
    data = ClientData(x, y, torch.arange(64), num_classes=2)
    local_train(model, data, train_cfg(precision, epochs), torch.Generator().manual_seed(5))
    with torch.no_grad():
        after = float(F.cross_entropy(model(x), y))
    return get_arrays(model), before, after


# --- the policy itself ---------------------------------------------------------------------


def test_policy_names_and_contexts() -> None:
    assert PRECISIONS == ("fp32", "bf16")
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with autocast("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert layer(x).dtype == torch.float32
    with autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert layer(x).dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32
    for bad in ("fp16", "BF16", "", None):
        with pytest.raises(UsageError, match="precision must be one of fp32, bf16"):
            check_precision(bad)
    with pytest.raises(UsageError):
        autocast("fp16", "cpu")


# --- local training ------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_autocast_covers_forward_and_loss_terms_but_not_backward(precision: str) -> None:
    """The loss function and the plug-in terms run under the policy; the step hook (after
    backward) and the gradients do not; parameters and optimizer state stay fp32."""
    x, y = separable_images(32, seed=2)
    model = fresh_model()
    seen: dict[str, list] = {"loss_fn": [], "term": [], "hook": []}

    def loss_fn(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> LossOutput:
        features = m.body(xb)
        logits = m.head(features)
        seen["loss_fn"].append((torch.is_autocast_enabled("cpu"), logits.dtype))
        return LossOutput(F.cross_entropy(logits, yb), features, logits)

    def term(features: torch.Tensor, logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        seen["term"].append((torch.is_autocast_enabled("cpu"), features.dtype))
        return 0.0 * features.float().sum()

    def hook(m: torch.nn.Module) -> None:
        grads = {p.grad.dtype for p in m.parameters()}
        seen["hook"].append((torch.is_autocast_enabled("cpu"), grads))

    opt = make_optimizer(model, train_cfg(precision))
    data = ClientData(x, y, torch.arange(32), num_classes=2)
    result = local_train(
        model,
        data,
        train_cfg(precision, epochs=1),
        torch.Generator().manual_seed(0),
        loss_fn=loss_fn,
        before_step=hook,
        optimizer=opt,
        extra_terms=[term],
    )
    expected = torch.bfloat16 if precision == "bf16" else torch.float32
    on = precision == "bf16"
    assert result.steps == 2
    assert seen["loss_fn"] == [(on, expected)] * 2
    assert seen["term"] == [(on, expected)] * 2
    assert seen["hook"] == [(False, {torch.float32})] * 2
    assert math.isfinite(result.mean_loss)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert {b.dtype for b in buffers} == {torch.float32}


def test_bf16_and_fp32_both_train_and_differ() -> None:
    fp32, before32, after32 = train("fp32")
    bf16, before16, after16 = train("bf16")
    assert before32 == before16  # same initial model and data
    assert after32 < 0.5 * before32
    assert after16 < 0.5 * before16
    assert all(v.dtype == torch.float32 for v in bf16.values())
    # bf16 rounds every activation: the trained weights cannot match fp32 exactly.
    assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32)


def test_bf16_training_is_deterministic() -> None:
    a, _, _ = train("bf16", epochs=1)
    b, _, _ = train("bf16", epochs=1)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fedavg_client_uploads_fp32_under_bf16() -> None:
    x, y = separable_images(48, seed=3)
    model = fresh_model()
    sent = get_arrays(model)
    ctx = ClientContext(
        client_id=0,
        round=0,
        seed=0,
        data=ClientData(x, y, torch.arange(48), num_classes=2),
        model=model,
        state=ClientState(),
        train=train_cfg("bf16", epochs=1),
    )
    reply = FedAvg.Client(FedAvg.make_params({})).handle(Message("train", arrays=sent), ctx)
    assert list(reply.arrays) == list(sent)
    for k, v in reply.arrays.items():
        assert v.dtype == torch.float32, k
        assert not torch.equal(v, sent[k]), k  # it trained
    # 4 bytes per parameter: a bf16 upload would be half the size.
    assert reply.nbytes() == 4 * sum(v.numel() for v in sent.values()) + 8 * len(reply.scalars)


# --- evaluation ----------------------------------------------------------------------------


def reference_evaluation(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, classes: int, batch: int
) -> tuple[float, float, np.ndarray]:
    """Accuracy, mean loss and per-class hits computed batch by batch in plain fp32."""
    correct = np.zeros(classes, dtype=np.int64)
    loss_sum = 0.0
    model.eval()
    with torch.no_grad():
        for s in range(0, len(y), batch):
            logits = model(x[s : s + batch])
            loss_sum += float(F.cross_entropy(logits, y[s : s + batch], reduction="sum"))
            for pred, label in zip(
                logits.argmax(1).tolist(), y[s : s + batch].tolist(), strict=True
            ):
                correct[label] += pred == label
    return correct.sum() / len(y), loss_sum / len(y), correct


def test_fp32_evaluation_matches_a_plain_loop_exactly() -> None:
    x, y = separable_images(70, seed=4)
    y = y + 2 * (torch.arange(70) % 3 == 0).long()  # four classes of unequal sizes
    model = build_model("fedavg-cnn", SHAPE, 5)
    model.train()
    result = evaluate(model, x, y, 5, batch_size=32)
    assert model.training  # restored
    accuracy, loss, correct = reference_evaluation(model, x, y, 5, batch=32)
    counts = np.bincount(y.numpy(), minlength=5)
    assert result.accuracy == accuracy
    assert result.loss == loss
    assert result.class_counts.tolist() == counts.tolist()
    assert np.isnan(result.per_class_accuracy[4])  # class 4 is absent
    np.testing.assert_array_equal(result.per_class_accuracy[:4], correct[:4] / counts[:4])


def test_bf16_evaluation_runs_under_autocast_without_autograd() -> None:
    x, y = separable_images(40, seed=5)
    model = fresh_model()
    seen = []

    def record(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.append((output.dtype, torch.is_inference_mode_enabled(), output.requires_grad))

    model.head.register_forward_hook(record)
    bf16 = evaluate(model, x, y, 2, batch_size=16, precision="bf16")
    assert seen == [(torch.bfloat16, True, False)] * 3  # batches of 16, 16, 8
    seen.clear()
    fp32 = evaluate(model, x, y, 2, batch_size=16)
    assert seen == [(torch.float32, True, False)] * 3
    assert bf16.class_counts.tolist() == fp32.class_counts.tolist() == [20, 20]
    # The same model scored in bf16: the loss moves by the rounding, not by more.
    assert abs(bf16.loss - fp32.loss) < 0.05 * fp32.loss
    # bf16 logits, loss taken in fp32 (a bf16 log-softmax would round it a second time).
    loss_sum = 0.0
    with torch.no_grad():
        for s in range(0, 40, 16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x[s : s + 16])
            loss_sum += float(F.cross_entropy(logits.float(), y[s : s + 16], reduction="sum"))
    assert bf16.loss == pytest.approx(loss_sum / 40, rel=1e-6)
    assert 0.0 <= bf16.accuracy <= 1.0


# --- configuration and the command line ----------------------------------------------------


def test_config_validates_precision() -> None:
    assert ExperimentConfig().precision == "fp32"
    ExperimentConfig(precision="bf16").validate()
    with pytest.raises(UsageError, match="precision must be one of fp32, bf16, got 'fp16'"):
        ExperimentConfig(precision="fp16").validate()


def test_bad_precision_on_the_command_line_is_one_line_exit_2(tmp_path, capsys) -> None:
    code = main(["run", "--precision", "fp16", "-q", "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["fedskew: error: precision must be one of fp32, bf16, got 'fp16'"]
    assert not any(tmp_path.iterdir())


def write_fmnist_idx(folder: Path, n_train: int, n_test: int) -> None:
    """A tiny Fashion-MNIST in its official gzipped idx format (random images)."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.arange(n_test, dtype=np.uint8) % 10,
    }
    folder.mkdir(parents=True)
    for name, array in arrays.items():
        header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(
            f">{array.ndim}I", *array.shape
        )
        (folder / f"{name}.gz").write_bytes(gzip.compress(header + array.tobytes()))


def test_cli_bf16_run_with_fedavg_cnn_on_fmnist_format(tmp_path, monkeypatch) -> None:
    write_fmnist_idx(tmp_path / "data", n_train=200, n_test=50)
    policies = []

    def recording_evaluate(*args: object, **kwargs: object) -> object:
        policies.append(kwargs.get("precision", "fp32"))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(experiment, "evaluate", recording_evaluate)
    args = ["run", "-d", "fmnist", "--data-dir", str(tmp_path / "data"), "--no-download"]
    args += ["-m", "fedavg-cnn", "-n", "4", "--clients-per-round", "2", "--beta", "1.0"]
    args += ["--precision", "bf16", "--rounds", "2", "-e", "1", "-q", "-o", str(tmp_path)]
    assert main([*args, "--name", "r"]) == 0
    folder = tmp_path / "r"
    config = json.loads((folder / "config.json").read_text())
    assert config["precision"] == "bf16" and config["resolved"]["model"] == "fedavg-cnn"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["accuracy"]) and math.isfinite(r["loss"])
        # fp32 on the wire: the model's 4-byte parameters to each of the two clients.
        assert r["bytes_down"] == 2 * 4 * 582_026
    assert policies == ["bf16", "bf16"]  # the global model is scored in the run's policy


def test_bf16_survives_resume_and_resumes_exactly(tmp_path) -> None:
    class Killed(Exception):
        pass

    def kill_after_2(record: dict) -> None:
        if record["round"] == 2:
            raise Killed

    common = dict(rounds=4, local_epochs=1, quiet=True, seed=2, precision="bf16", name="r")
    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), **common))
    with pytest.raises(Killed):
        run(ExperimentConfig(out_dir=str(tmp_path / "b"), **common), on_round=kill_after_2)
    unfinished = tmp_path / "b" / "r.incomplete"
    assert json.loads((unfinished / "config.json").read_text())["precision"] == "bf16"
    assert main(["run", "--resume", str(unfinished), "--precision", "fp32"]) == 2
    assert main(["run", "--resume", str(unfinished), "-q"]) == 0
    keys = ("round", "clients", "accuracy", "loss", "train_loss", "per_class_accuracy")

    def rows(folder: Path) -> list[dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: json.loads(line)[k] for k in keys} for line in lines]

    assert rows(tmp_path / "b" / "r") == rows(full)
    # Resumed under bf16, not the fp32 default: an fp32 run gives other numbers.
    fp32, _ = run(ExperimentConfig(out_dir=str(tmp_path / "c"), **{**common, "precision": "fp32"}))
    assert rows(fp32) != rows(full)


def _loss_term_cases() -> list[tuple[str, object, tuple]]:
    from fedskew.algorithms.feature_matching import cg_loss, l2_loss
    from fedskew.algorithms.fedacd import flat_kl
    from fedskew.algorithms.fedcme import alignment_loss
    from fedskew.algorithms.feddecorr import decorrelation_loss
    from fedskew.algorithms.feddyn import dynamic_terms
    from fedskew.algorithms.fedntd import not_true_distillation
    from fedskew.algorithms.fedproto import prototype_regulariser
    from fedskew.algorithms.moon import model_contrastive_loss

    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()  # what a bf16 forward hands over

    y = torch.randint(0, 10, (64,), generator=g)
    z, logits = rnd(64, 32), 4 * rnd(64, 10)
    anchors, known = torch.randn(10, 32, generator=g), torch.ones(10, dtype=torch.bool)
    params = [(torch.randn(300, generator=g), torch.randn(300, generator=g),
               torch.randn(300, generator=g))]  # fmt: skip
    return [
        ("fedntd", not_true_distillation, (logits, 4 * rnd(64, 10), y, 1.0)),
        ("fedacd", lambda a, b: flat_kl(a, b).mean(), (logits, y)),
        ("fedfm cg", cg_loss, (z, y, anchors, 0.1)),
        ("fedfm l2", l2_loss, (z, y, anchors)),
        ("feddecorr", decorrelation_loss, (z,)),
        ("moon", model_contrastive_loss, (z, rnd(64, 32), rnd(64, 32), 0.5)),
        ("fedcme", alignment_loss, (z, y, anchors, known)),
        ("fedproto", prototype_regulariser, (z, y, anchors, known, "mse")),
        ("feddyn", lambda v: torch.stack(dynamic_terms(v)), (params,)),
    ]


@pytest.mark.parametrize("case", range(9))
def test_loss_terms_are_computed_in_fp32_under_bf16_autocast(case: int) -> None:
    # The reference: the same bf16 inputs, cast up by hand, with no autocast anywhere.
    name, fn, args = _loss_term_cases()[case]

    def up(a: object) -> object:
        return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a

    reference = fn(*(up(a) for a in args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = fn(*args)
    assert under_autocast.dtype == torch.float32, name
    torch.testing.assert_close(under_autocast, reference, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_bf16_instructions_says_it_is_emulated(
    tmp_path, monkeypatch, caplog, native
):
    features = {"torch_cpu_capability": "AVX2", "flags": {}, "native_bf16": native}
    monkeypatch.setattr(experiment, "cpu_features", lambda: features)
    cfg = ExperimentConfig(
        precision="bf16", rounds=1, local_epochs=1, num_clients=2, device="cpu",
        out_dir=str(tmp_path), quiet=True,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="fedskew.execution"):
        run(cfg)
    said = [r.message for r in caplog.records if "emulated" in r.message]
    assert len(said) == (0 if native else 1)
    if not native:
        assert "avx512_bf16" in said[0] and "amx_bf16" in said[0]


def test_run_folders_record_what_the_cpu_offers_torch(tmp_path):
    folder, _ = run(ExperimentConfig(rounds=1, local_epochs=1, out_dir=str(tmp_path), quiet=True))
    (process,) = [json.loads(x) for x in (folder / "processes.jsonl").read_text().splitlines()]
    assert process["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    expected = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    assert process["cpu_flags"] == (" ".join(expected) or "-")
