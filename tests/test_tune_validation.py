"""Tuning scores its trials on a validation split of the clients' training data, never on
the test set; tuned.json carries the objective's window; the pruner judges a trial only
from its warm-up after the round in which its last declared mechanism first acted, and the
default warm-up is the committed measurement's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

optuna = pytest.importorskip("optuna")

import fedskew.assembly.prepare as prepare_module  # noqa: E402
from fedskew.apps.cli import main  # noqa: E402
from fedskew.config import build_config  # noqa: E402
from fedskew.grid.plan import grid_from, read_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TUNE = """
[tune]
trials = {trials}
seeds = [100]
last = 2
pruner = "{pruner}"
pruner_warmup = {warmup}
pruner_startup = 0
sampler = "random"

[compare]
seeds = [0]
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
rounds = {rounds}
local_epochs = 1
batch_size = 64
{methods}
"""

FEDAVG = """
[methods.fedavg.search]
lr = { log = [0.01, 0.1] }
"""

FEDFM = """
[methods.fedfm]
params = { lam = 1.0 }
[methods.fedfm.search]
lr = { log = [0.01, 0.1] }
params.start_round = { int = [0, 3] }
"""


def tune_file(tmp_path: Path, methods: str, trials: int = 1, rounds: int = 2,
              pruner: str = "none", warmup: int = 0) -> Path:  # fmt: skip
    file = tmp_path / "study.toml"
    file.write_text(TUNE.format(trials=trials, rounds=rounds, pruner=pruner, warmup=warmup,
                                methods=methods))  # fmt: skip
    return file


def study(out: Path, method: str) -> optuna.Study:
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    return optuna.load_study(study_name=f"study.{method}", storage=storage)


def test_the_objective_does_not_change_when_the_test_labels_are_scrambled(tmp_path, monkeypatch):
    """A trial scores the validation split: the same trial with the test set's labels
    permuted gets the same objective, to the bit."""
    file = tune_file(tmp_path, FEDAVG)
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "plain")]) == 0
    real = prepare_module.load_dataset

    def scrambled(*args, **kwargs):
        data = real(*args, **kwargs)
        data.y_test = data.y_test[torch.randperm(len(data.y_test), generator=torch.Generator()
                                                 .manual_seed(1))]  # fmt: skip
        data.y_test = (data.y_test + 1) % data.num_classes  # no label left in place
        return data

    monkeypatch.setattr(prepare_module, "load_dataset", scrambled)
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "scrambled")]) == 0
    (plain,) = study(tmp_path / "plain", "fedavg").get_trials()
    (other,) = study(tmp_path / "scrambled", "fedavg").get_trials()
    assert plain.params == other.params
    assert plain.value == other.value and plain.value > 20  # not a scrambled-label score


def test_each_trial_records_its_validation_split(tmp_path):
    file = tune_file(tmp_path, FEDAVG)
    text = file.read_text().replace("sampler = ", "validation = 0.25\nsampler = ")
    file.write_text(text)
    out = tmp_path / "out"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    saved = json.loads((out / "trials" / "fedavg-t0-s100" / "config.json").read_text())
    assert saved["validation_fraction"] == 0.25
    split = saved["resolved"]["validation_split"]
    assert saved["resolved"]["evaluated_on"] == "validation"
    assert split["fraction"] == 0.25 and split["seed"] == 100
    assert split["samples"] == sum(split["client_samples"]) == saved["resolved"]["test_samples"]
    # digits: 1437 training samples; a quarter of each client's, rounded per client
    assert abs(split["samples"] - 0.25 * saved["resolved"]["train_samples"]) <= 4
    assert len(split["digest"]) >= 16
    record = json.loads((out / "tune.json").read_text())
    assert record["validation"]["fraction"] == 0.25 and "validation" in record["objective"]


def test_the_validation_split_is_held_out_of_training_and_stratified():
    cfg = build_config({"dataset": "digits", "num_clients": 4, "rounds": 1,
                        "validation_fraction": 0.2}, {})  # fmt: skip
    prep = prepare_module.prepare(cfg)
    assert prep.validation is not None
    whole = prep.clients_data
    for train, held, all_of in zip(prep.partition, prep.validation, whole, strict=True):
        assert not set(train.tolist()) & set(held.tolist())
        assert sorted([*train.tolist(), *held.tolist()]) == sorted(all_of.tolist())
        assert abs(len(held) - 0.2 * len(all_of)) <= 1
    pooled = torch.cat([prep.dataset.y_train[torch.from_numpy(h)] for h in prep.validation])
    assert sorted(prep.y_test.tolist()) == sorted(pooled.tolist())


@pytest.mark.parametrize("fraction", ["0", "1.0", "true", "'x'"])
def test_a_bad_validation_fraction_is_one_line(tmp_path, capsys, fraction):
    file = tune_file(tmp_path, FEDAVG)
    file.write_text(file.read_text().replace("sampler = ", f"validation = {fraction}\nsampler = "))
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "[tune] validation" in err and err.count("\n") == 1


def test_an_experiment_with_a_validation_split_is_refused(tmp_path, capsys):
    """The evaluation of the tuned methods must report the test set."""
    file = tune_file(tmp_path, FEDAVG)
    file.write_text(file.read_text().replace("rounds = 2", "rounds = 2\nvalidation_fraction = 0.1"))
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "validation_fraction is for the trials" in err and err.count("\n") == 1


def test_tuned_json_carries_the_objectives_window(tmp_path):
    """[tune] last 2 while [compare] says nothing (compare's default is 10): the evaluation
    averages the rounds the trials were selected on."""
    file = tune_file(tmp_path, FEDAVG)
    out = tmp_path / "out"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    tuned = json.loads((out / "tuned.json").read_text())
    assert tuned["compare"]["last"] == 2
    assert "validation_fraction" not in tuned["experiment"]
    grid = grid_from(read_file(out / "tuned.json"), "tuned.json", {}, None, {})
    assert grid.options.last == 2


def test_judged_from_reads_the_methods_declared_mechanisms():
    from fedskew.grid.tune import judged_from

    base = {"dataset": "digits", "num_clients": 4, "rounds": 12}
    fedavg = build_config({**base, "algorithm": "fedavg"}, {})
    assert judged_from(fedavg, 0) == 1 and judged_from(fedavg, 4) == 5
    for start in (0, 3, 8):
        fedfm = build_config({**base, "algorithm": "fedfm", "params": {"start_round": start}}, {})
        assert judged_from(fedfm, 2) == start + 1 + 2  # 0-based launch: acts in round start+1
    never = build_config({**base, "algorithm": "fedfm", "params": {"start_round": 20}}, {})
    assert judged_from(never, 0) == 13  # past the run: never judged


def test_a_trial_reports_to_the_pruner_only_after_its_mechanisms_and_warmup(tmp_path):
    """FedFM trials launching at different rounds: each trial's first reported round is its
    launch round + 1 + warm-up, so a trial is only compared at a round with trials then in
    the same phase."""
    file = tune_file(tmp_path, FEDFM, trials=3, rounds=5, pruner="median", warmup=1)
    out = tmp_path / "out"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    trials = study(out, "fedfm").get_trials()
    assert len(trials) == 3
    for t in trials:
        first = t.params["params.start_round"] + 1 + 1
        reported = sorted(t.intermediate_values)
        assert reported == list(range(first, 6)) or (
            t.state.name == "PRUNED" and reported and reported[0] == first
        ), (t.params, reported)


def test_the_default_warmup_is_the_committed_measurement():
    from fedskew.grid.tune import DEFAULT_WARMUP

    results = ROOT / "benchmarks" / "results"
    first = json.loads((results / "tune_rank_correlation_first_study.json").read_text())
    rerun = json.loads((results / "tune_rank_correlation.json").read_text())
    # Set from the study's first run; the rerun under it needs no more.
    assert first["warmup"] == DEFAULT_WARMUP
    assert rerun["warmup"] <= DEFAULT_WARMUP
