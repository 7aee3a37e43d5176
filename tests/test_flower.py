"""The Flower engine: codec, reply checks, equivalence with the in-process engine, faults.

Most tests drive the real ServerApp logic (``serve``) and the real ClientApp through an
in-memory Grid that calls the ClientApp directly with one persistent Context per node, so
they run in seconds; ``test_flower_simulation_equals_inprocess`` (slow) runs
``--engine flower-sim`` on Flower's Simulation Runtime (a SuperLink in simulation mode, Ray).
Real SuperLink/SuperNode deployments are in test_flower_deployment.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from run_metrics import metrics

pytest.importorskip("flwr")

from flower_grid import LocalGrid  # noqa: E402
from flwr.app import Context, Error, MetricRecord, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402

import fedskew.apps.flower.server as flower_server  # noqa: E402
from fedskew.algorithms import ALGORITHMS  # noqa: E402
from fedskew.apps.flower import run_simulation  # noqa: E402
from fedskew.apps.flower.processes import end_processes, tagged_processes  # noqa: E402
from fedskew.apps.flower.run_config import (  # noqa: E402
    NOT_IN_RUN_CONFIG,
    OUTPUT_ROOT_VARIABLE,
    SERVER_KEYS,
    config_from_run_config,
    output_root,
    path_in_root,
    resumed_config,
    server_options,
)
from fedskew.apps.flower.server import _server_main, serve, setup_limit  # noqa: E402
from fedskew.apps.flower.simulation import simulation_run_config  # noqa: E402
from fedskew.config import ExperimentConfig, build_config  # noqa: E402
from fedskew.core.errors import FedskewError, UsageError  # noqa: E402
from fedskew.engines.flower_codec import (  # noqa: E402
    ARRAYS,
    SCALARS,
    RejectedReply,
    arrays_of,
    arrays_record,
    check_reply,
    check_sample_count,
    decode,
    encode,
)
from fedskew.runs.loop import run  # noqa: E402
from fedskew.training.protocol import ArraySpec, Message  # noqa: E402


def digits_cfg(tmp_path: Path, algorithm: str, **extra) -> ExperimentConfig:
    values = dict(
        algorithm=algorithm, num_clients=4, clients_per_round=3, rounds=3, local_epochs=2,
        out_dir=str(tmp_path), quiet=True,
    )  # fmt: skip
    values.update(extra)
    return build_config({}, values)


COMPARED = ("accuracy", "loss", "train_loss", "bytes_down", "bytes_up", "exchanges", "clients")


def assert_same_curves(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra.get(key) == rb.get(key), (ra["round"], key, ra.get(key), rb.get(key))


# --------------------------------------------------------------------------- codec


def test_codec_round_trip_keeps_values_dtypes_and_kind():
    msg = Message(
        "train_rest",
        arrays={
            "w": torch.randn(3, 4).to(memory_format=torch.contiguous_format),
            "conv": torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last),
            "steps": torch.tensor([7], dtype=torch.int64),
            "empty": torch.zeros(0),
        },
        scalars={"num_samples": 12.0, "loss": 0.25},
        strings={"names": "a,b"},
    )
    back, envelope = decode(encode(msg, {"round": 4, "client_id": 2}))
    assert back.kind == "train_rest"
    assert envelope == {"round": 4, "client_id": 2}
    assert back.scalars == msg.scalars and back.strings == msg.strings
    assert set(back.arrays) == set(msg.arrays)
    for name, t in msg.arrays.items():
        assert back.arrays[name].dtype == t.dtype
        assert torch.equal(back.arrays[name], t)
    assert back.nbytes() == msg.nbytes()


def test_check_reply_rejects_bad_shapes_dtypes_and_non_finite_values():
    ref = {"w": torch.zeros(2, 3), "n": torch.zeros(1, dtype=torch.int64)}
    check_reply(Message("trained", arrays={"w": torch.ones(2, 3), "extra": torch.ones(5)}), ref)
    bad = [
        Message("trained", arrays={"w": torch.ones(3, 2)}),
        Message("trained", arrays={"w": torch.ones(2, 3, dtype=torch.float64)}),
        Message("trained", arrays={"n": torch.ones(1)}),
        Message("trained", arrays={"w": torch.tensor([[0.0, math.nan, 0], [0, 0, 0]])}),
        Message("trained", arrays={"extra": torch.tensor([math.inf])}),
        Message("trained", scalars={"loss": math.nan}),
    ]
    for msg in bad:
        with pytest.raises(RejectedReply):
            check_reply(msg, ref)


def test_run_config_maps_to_experiment_config(tmp_path):
    root = tmp_path.resolve()
    cfg_file = root / "exp.toml"
    cfg_file.write_text('algorithm = "fedprox"\nrounds = 7\n[params]\nmu = 0.1\n')
    cfg = config_from_run_config(
        {
            "config-file": "exp.toml",  # relative to the output root
            "num-clients": 5,
            "clients-per-round": "",
            "params": "mu=0.5",
            "partition-params": "beta=0.3",
            "name": "",
        },
        root,
    )
    assert cfg.algorithm == "fedprox" and cfg.rounds == 7 and cfg.num_clients == 5
    assert cfg.params == {"mu": 0.5} and cfg.partition_params == {"beta": 0.3}
    assert cfg.engine == "flower" and cfg.name is None
    assert cfg.out_dir == str(root)  # no out-dir: the root itself
    with pytest.raises(UsageError):
        config_from_run_config({"params": "mu"}, root)
    with pytest.raises(UsageError):
        config_from_run_config({"no-such-key": 1}, root)


# --------------------------------------------------------------------------- output root


def test_output_root_is_the_operators_and_is_created(tmp_path, monkeypatch):
    monkeypatch.delenv(OUTPUT_ROOT_VARIABLE, raising=False)
    with pytest.raises(UsageError, match=f"{OUTPUT_ROOT_VARIABLE} is not set"):
        output_root()
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, "relative/runs")
    with pytest.raises(UsageError, match="absolute"):
        output_root()
    # A fresh machine: the folder the operator named is made, parents included.
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path / "srv" / "runs"))
    assert output_root() == (tmp_path / "srv" / "runs").resolve()
    assert (tmp_path / "srv" / "runs").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path / "file"))
    with pytest.raises(UsageError, match="is not a folder"):
        output_root()
    # One that cannot be made: one line naming it and why.
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path / "file" / "runs"))
    with pytest.raises(UsageError, match=r"file/runs: cannot create the output root \("):
        output_root()
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path))
    assert output_root() == tmp_path.resolve()


def test_run_config_paths_stay_inside_the_output_root(tmp_path):
    root = (tmp_path / "root").resolve()
    (root / "ok").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    assert path_in_root(root, "team/a", "out-dir") == root / "team" / "a"
    for bad in ("/tmp/x", str(root / "ok"), "../x", "ok/../../x", "escape", "escape/y", "a\0b"):
        with pytest.raises(UsageError):
            path_in_root(root, bad, "out-dir")
    # resume alone may be absolute, when it lies inside the root
    assert path_in_root(root, str(root / "ok"), "resume", absolute_ok=True) == root / "ok"
    with pytest.raises(UsageError, match="outside"):
        path_in_root(root, str(tmp_path / "outside"), "resume", absolute_ok=True)

    def cfg(**run_config):
        return config_from_run_config(run_config, root)

    assert cfg(**{"out-dir": "team"}).out_dir == str(root / "team")
    for key, value in [
        ("out-dir", "/srv/elsewhere"),
        ("out-dir", "../elsewhere"),
        ("config-file", str(tmp_path / "exp.toml")),
        ("config-file", "../exp.toml"),
        ("partition-file", "/etc/passwd"),
        ("data-dir", "/data"),
        ("name", "../x"),
        ("name", "a/b"),
    ]:
        with pytest.raises(UsageError):
            cfg(**{key: value}).validate()
    # A config file (itself inside the root) cannot lead outside either.
    for line in ('out_dir = "/srv/elsewhere"', 'data_dir = "/data"', 'partition_file = "/x.npz"',
                 f'track_dir = "{tmp_path / "outside"}"', 'workers = 2'):  # fmt: skip
        (root / "exp.toml").write_text(line + "\n")
        with pytest.raises(UsageError):
            cfg(**{"config-file": "exp.toml"})
    (root / "exp.toml").write_text('track_dir = "/tmp/x"\n')
    with pytest.raises(UsageError, match="config-file sets 'track_dir'"):
        cfg(**{"config-file": "exp.toml"})
    (root / "exp.toml").write_text('out_dir = "from-file"\n')
    assert cfg(**{"config-file": "exp.toml"}).out_dir == str(root / "from-file")
    # resume names an unfinished run folder inside the root, never the root itself
    for bad in ("/tmp", "..", ".", str(root)):
        with pytest.raises(UsageError):
            resumed_config(bad, root)
    assert not list((tmp_path / "outside").iterdir())


def test_deployed_server_writes_only_under_the_output_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(root))
    small = {"num-clients": 2, "clients-per-round": 2, "rounds": 1, "local-epochs": 1}

    def server_main(**run_config):
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                          run_config={**small, "quiet": True, **run_config})  # fmt: skip
        _server_main(LocalGrid(2), context)

    server_main(**{"out-dir": "team", "name": "r1"})
    assert (root / "team" / "r1" / "summary.json").is_file()
    elsewhere = str(tmp_path / "elsewhere")
    for bad in ({"out-dir": elsewhere}, {"out-dir": "../elsewhere"}, {"name": "../elsewhere"},
                {"resume": elsewhere + ".incomplete"}):  # fmt: skip
        with pytest.raises(UsageError):
            server_main(**bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    monkeypatch.delenv(OUTPUT_ROOT_VARIABLE)
    with pytest.raises(UsageError, match=OUTPUT_ROOT_VARIABLE):
        server_main(name="r2")
    assert not (root / "r2").exists()


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    "algorithm,params",
    [
        ("fedavg", {}),
        ("fedcme", {}),
        ("fedfm", {"start_round": 1, "lam": 5}),
        ("fedacd", {}),
        ("scaffold", {}),  # per-client control variates live in the node's context.state
        ("moon", {}),  # the previous local model too
    ],
)
def test_flower_engine_equals_inprocess(tmp_path, algorithm, params):
    cfg = digits_cfg(tmp_path / "ip", algorithm, params=params)
    folder_ip, summary_ip = run(cfg)
    cfg_fl = digits_cfg(tmp_path / "fl", algorithm, params=params)
    grid = LocalGrid(cfg_fl.num_clients)
    folder_fl, summary_fl = serve(grid, cfg_fl)
    a, b = metrics(folder_ip), metrics(folder_fl)
    assert_same_curves(a, b)
    assert all(r["missing_replies"] == [] and r["rejected_replies"] == [] for r in b)
    assert summary_fl["final_accuracy"] == summary_ip["final_accuracy"]
    # The client state is measured where the server holds it; on Flower the nodes do.
    assert "client_state_bytes_max" in summary_ip and "client_state_bytes_max" not in summary_fl


def test_a_batchnorm_model_on_flower_equals_inprocess(tmp_path):
    """A BatchNorm's batch counter is a 0-d array: it must travel as one (it was sent 1-d,
    and every reply of such a model was rejected, so no round aggregated anything)."""
    import tiny_bn

    cfg_ip = digits_cfg(tmp_path / "ip", "fedavg", model=tiny_bn.NAME, rounds=2)
    cfg_fl = digits_cfg(tmp_path / "fl", "fedavg", model=tiny_bn.NAME, rounds=2)
    folder_ip, _ = run(cfg_ip)
    folder_fl, _ = serve(LocalGrid(4), cfg_fl)
    rows = metrics(folder_fl)
    assert all(r["rejected_replies"] == [] for r in rows)
    assert_same_curves(metrics(folder_ip), rows)
    zero_d = {"n": torch.tensor(7, dtype=torch.int64)}
    assert arrays_of(arrays_record(zero_d))["n"].shape == ()


def test_feature_matching_plugin_on_flower_equals_inprocess(tmp_path):
    extra = dict(feature_matching=True, params={"start_round": 1, "lam": 5})
    folder_ip, _ = run(digits_cfg(tmp_path / "ip", "fedprox", **extra))
    folder_fl, _ = serve(LocalGrid(4), digits_cfg(tmp_path / "fl", "fedprox", **extra))
    assert_same_curves(metrics(folder_ip), metrics(folder_fl))


# --------------------------------------------------------------------------- faults


def test_lost_reply_is_recorded_and_the_round_uses_the_others(tmp_path):
    cfg = digits_cfg(tmp_path, "fedavg", clients_per_round=4)
    grid = LocalGrid(4, drop={(1, 2)})  # client 2's reply in round 2 (0-based round 1)
    folder, summary = serve(grid, cfg)
    rows = metrics(folder)
    assert [r["missing_replies"] for r in rows] == [[], [2], []]
    assert rows[1]["bytes_up"] * 4 == rows[0]["bytes_up"] * 3
    assert rows[1]["samples"] < rows[0]["samples"]
    assert math.isfinite(summary["final_accuracy"])


def test_corrupt_reply_is_rejected_never_aggregated(tmp_path):
    def poison(content: RecordDict) -> None:
        arrays = arrays_of(content.array_records[ARRAYS])
        first = next(iter(arrays))
        arrays[first][...] = math.nan
        content[ARRAYS] = arrays_record(arrays)

    def reshape(content: RecordDict) -> None:
        arrays = arrays_of(content.array_records[ARRAYS])
        first = next(iter(arrays))
        arrays[first] = arrays[first].reshape(-1)
        content[ARRAYS] = arrays_record(arrays)

    cfg = digits_cfg(tmp_path / "bad", "fedavg", clients_per_round=4, rounds=2)
    grid = LocalGrid(4, corrupt={(0, 1): poison, (1, 3): reshape})
    folder, summary = serve(grid, cfg)
    rows = metrics(folder)
    assert rows[0]["rejected_replies"] == [1] and rows[0]["missing_replies"] == [1]
    assert rows[1]["rejected_replies"] == [3] and rows[1]["missing_replies"] == [3]
    assert math.isfinite(rows[-1]["loss"]) and math.isfinite(summary["final_accuracy"])
    # A rejected reply is treated exactly like a lost one: same curve as dropping it.
    cfg_lost = digits_cfg(tmp_path / "lost", "fedavg", clients_per_round=4, rounds=2)
    lost, _ = serve(LocalGrid(4, drop={(0, 1), (1, 3)}), cfg_lost)
    assert_same_curves(rows, metrics(lost))
    # ...and differs from a run where the reply was aggregated.
    cfg_ok = digits_cfg(tmp_path / "ok", "fedavg", clients_per_round=4, rounds=2)
    ok, _ = serve(LocalGrid(4), cfg_ok)
    assert metrics(ok)[0]["loss"] != rows[0]["loss"]


# Small enough to run every algorithm in seconds; CReFF's server-side steps shortened.
FAST_PARAMS = {
    "creff": {"match_epochs": 2, "crt_epochs": 2, "num_features": 5},
    "fedfm": {"start_round": 1, "lam": 5},
    "fedfm-lite": {"start_round": 1, "lam": 5, "a": 2},
}


def _without(content: RecordDict, array: str | None = None, scalar: str | None = None) -> None:
    """Leave one array or number out of a reply (all of them for "*")."""
    arrays = arrays_of(content.array_records[ARRAYS])
    scalars = dict(content.metric_records[SCALARS])
    if array is not None:
        arrays = {} if array == "*" else {k: v for k, v in arrays.items() if k != array}
    if scalar is not None:
        scalars = {} if scalar == "*" else {k: v for k, v in scalars.items() if k != scalar}
    content[ARRAYS] = arrays_record(arrays)
    content[SCALARS] = MetricRecord(scalars)


@pytest.mark.parametrize("left_out", ["array", "scalar"])
def test_reply_lacking_what_fedavg_reads_is_rejected_like_a_lost_one(tmp_path, left_out, caplog):
    if left_out == "array":  # a model entry: the average would fail on it
        corrupt = {(0, 2): lambda c: _without(c, array="body.fc2.bias")}
        why = "lacks the array 'body.fc2.bias'"
    else:  # the sample count: the weights would
        corrupt = {(0, 2): lambda c: _without(c, scalar="num_samples")}
        why = "lacks the number 'num_samples'"
    cfg = digits_cfg(tmp_path / "bad", "fedavg", clients_per_round=4, rounds=2)
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, _ = serve(LocalGrid(4, corrupt=corrupt), cfg)
    warnings = [r.getMessage() for r in caplog.records]
    rows = metrics(folder)
    assert rows[0]["rejected_replies"] == [2] and rows[0]["missing_replies"] == [2]
    assert rows[1]["rejected_replies"] == []
    assert any(why in w for w in warnings), warnings
    cfg_lost = digits_cfg(tmp_path / "lost", "fedavg", clients_per_round=4, rounds=2)
    lost, _ = serve(LocalGrid(4, drop={(0, 2)}), cfg_lost)
    assert_same_curves(rows, metrics(lost))


def _claiming(samples: float):
    def corrupt(content: RecordDict) -> None:
        scalars = dict(content.metric_records[SCALARS])
        scalars["num_samples"] = samples
        content[SCALARS] = MetricRecord(scalars)

    return corrupt


def test_a_sample_count_the_client_cannot_have_is_rejected_like_a_lost_reply(tmp_path, caplog):
    """Every method weighs a reply by its num_samples: a node claiming 1e30 would own the
    average, 0 or a negative count would break it. The server knows each client's size from
    its own partition, so any other count is refused and the round goes on without it."""
    corrupt = {(0, 1): _claiming(1e30), (0, 2): _claiming(-5.0), (1, 0): _claiming(0.0)}
    cfg = digits_cfg(tmp_path / "bad", "fedavg", clients_per_round=4, rounds=2)
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, summary = serve(LocalGrid(4, corrupt=corrupt), cfg)
    rows = metrics(folder)
    assert rows[0]["rejected_replies"] == [1, 2] and rows[1]["rejected_replies"] == [0]
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "num_samples 1e+30 is not the client's" in warnings
    assert "num_samples -5.0 is not a whole number above 0" in warnings
    assert math.isfinite(summary["final_accuracy"])
    lost, _ = serve(
        LocalGrid(4, drop={(0, 1), (0, 2), (1, 0)}),
        digits_cfg(tmp_path / "lost", "fedavg", clients_per_round=4, rounds=2),
    )
    assert_same_curves(rows, metrics(lost))
    assert check_sample_count(Message("r", scalars={"num_samples": 7.0}), 7) is None
    with pytest.raises(RejectedReply):
        check_sample_count(Message("r", scalars={"num_samples": 7.5}), None)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_survives_an_empty_reply(tmp_path, algorithm):
    """A node that answers with no arrays and no numbers (all its replies of round 1) is
    left out; the run goes on with the others instead of failing in the aggregation."""
    params = dict(FAST_PARAMS.get(algorithm, {}))
    cfg = digits_cfg(tmp_path, algorithm, clients_per_round=4, rounds=2, local_epochs=2,
                     params=params)  # fmt: skip
    corrupt = {(0, 1): lambda c: _without(c, array="*", scalar="*")}
    folder, summary = serve(LocalGrid(4, corrupt=corrupt), cfg)
    rows = metrics(folder)
    assert rows[0]["rejected_replies"] == [1]
    assert rows[1]["rejected_replies"] == [] and rows[1]["missing_replies"] == []
    assert math.isfinite(summary["final_accuracy"])


@pytest.mark.parametrize(
    "algorithm,feature_matching",
    [(name, False) for name in sorted(ALGORITHMS)] + [("scaffold", True), ("fedproto", True)],
)
def test_every_algorithm_s_replies_fit_what_it_declares(tmp_path, algorithm, feature_matching):
    """The Flower engine rejects an array no declaration covers, so a real run of each
    algorithm (and of the plug-in on two with arrays of their own) must lose no reply."""
    params = dict(FAST_PARAMS.get(algorithm, {}))
    if feature_matching:
        params.update(start_round=1, lam=5)
    cfg = digits_cfg(tmp_path, algorithm, rounds=2, local_epochs=1, params=params,
                     feature_matching=feature_matching)  # fmt: skip
    folder, _ = serve(LocalGrid(4), cfg)
    rows = metrics(folder)
    assert [r["rejected_replies"] for r in rows] == [[], []]
    assert [r["missing_replies"] for r in rows] == [[], []]


def test_declared_reply_arrays_are_checked_for_shape_dtype_and_class_indices():
    ref = {"w": torch.zeros(2, 3)}
    declared = {
        "means": ArraySpec(("n", 4)),
        "classes": ArraySpec(("n",), torch.int64, classes=10),
    }
    good = {"means": torch.ones(3, 4), "classes": torch.tensor([0, 4, 9])}
    check_reply(Message("trained", arrays={"w": torch.ones(2, 3), **good}), ref, declared)
    check_reply(Message("trained", arrays={"means": torch.ones(0, 4),
                                           "classes": torch.zeros(0, dtype=torch.int64)}),
                ref, declared)  # fmt: skip  # a client may hold no class
    bad = {
        "not declared": {**good, "extra": torch.ones(5)},
        "fixed size": {**good, "means": torch.ones(3, 5)},
        "named size disagrees": {**good, "means": torch.ones(2, 4)},
        "rank": {**good, "classes": torch.tensor([[0, 4, 9]])},
        "dtype": {**good, "classes": torch.tensor([0.0, 4.0, 9.0])},
        "class out of range": {**good, "classes": torch.tensor([0, 4, 10])},
        "negative class": {**good, "classes": torch.tensor([0, -1, 9])},
        "repeated class": {**good, "classes": torch.tensor([0, 4, 4])},
        "non-finite": {**good, "means": torch.full((3, 4), math.inf)},
    }
    for case, arrays in bad.items():
        with pytest.raises(RejectedReply):
            check_reply(Message("trained", arrays=arrays), ref, declared)
            pytest.fail(case)
    # An algorithm that declares nothing (None) leaves the arrays its clients add unchecked.
    check_reply(Message("trained", arrays=bad["not declared"]), ref, None)


def test_mis_shaped_anchors_are_rejected_before_aggregation(tmp_path):
    def cut_anchors(content: RecordDict) -> None:
        arrays = arrays_of(content.array_records[ARRAYS])
        if "fm.anchors" in arrays:  # the anchor reply, not the trained model
            arrays["fm.anchors"] = arrays["fm.anchors"][:, :-1]
            content[ARRAYS] = arrays_record(arrays)

    cfg = digits_cfg(tmp_path, "fedfm", clients_per_round=4, rounds=2,
                     params={"start_round": 1, "lam": 5})  # fmt: skip
    folder, summary = serve(LocalGrid(4, corrupt={(0, 2): cut_anchors}), cfg)
    rows = metrics(folder)
    assert rows[0]["rejected_replies"] == [2] and rows[1]["rejected_replies"] == []
    assert math.isfinite(summary["final_accuracy"])


def test_round_without_replies_is_skipped_and_state_kept(tmp_path):
    cfg = digits_cfg(tmp_path, "scaffold", clients_per_round=2, rounds=3)
    from fedskew.data.federated import sample_clients

    lost = {(1, c) for c in sample_clients(cfg.seed, 1, 4, 2)}
    folder, _ = serve(LocalGrid(4, drop=lost), cfg)
    rows = metrics(folder)
    assert rows[1].get("skipped") == 1.0
    assert sorted(rows[1]["missing_replies"]) == sorted(c for _, c in lost)
    # The model did not move in the skipped round: its evaluation equals round 1's.
    assert rows[1]["accuracy"] == rows[0]["accuracy"] and rows[1]["loss"] == rows[0]["loss"]
    assert len(rows) == 3


def test_partition_without_node_counts_as_missing(tmp_path):
    cfg = digits_cfg(tmp_path, "fedavg", clients_per_round=4, rounds=1)
    grid = LocalGrid(4)
    del grid.contexts[1003]  # partition 3 never connected
    folder, _ = serve(grid, cfg, node_wait=0.2)
    assert metrics(folder)[0]["missing_replies"] == [3]


def test_a_second_node_claiming_a_partition_is_left_out_and_the_run_goes_on(tmp_path, caplog):
    cfg = digits_cfg(tmp_path, "fedavg", clients_per_round=4, rounds=1)
    grid = LocalGrid(4)
    grid.contexts[1003].node_config["partition-id"] = 0
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, _ = serve(grid, cfg, node_wait=0.2)
    assert "node 1003 left out: it also claims partition 0, held by node 1000" in caplog.text
    assert metrics(folder)[0]["missing_replies"] == [3]


# --------------------------------------------------------------------------- setup


def test_slow_setup_says_which_partitions_are_still_starting(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(flower_server, "PROGRESS_SECONDS", 0.3)
    monkeypatch.setattr(flower_server, "POLL_SECONDS", 0.05)
    cfg = digits_cfg(tmp_path, "fedavg", clients_per_round=4, rounds=1)
    grid = LocalGrid(4, setup_delay={2: 1.0, 3: 1.0})
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, _ = serve(grid, cfg, setup_timeout=30.0)
    progress = [r.getMessage() for r in caplog.records if "Flower setup" in r.getMessage()]
    assert progress and "2 of 4 nodes ready" in progress[0]
    assert "partitions still starting: 2-3" in progress[0]
    assert metrics(folder)[0]["missing_replies"] == []  # slow, not lost: all four trained


def test_setup_gives_up_only_after_no_answer_for_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(flower_server, "POLL_SECONDS", 0.05)
    # Answers keep coming (one every 0.3 s): a 0.5 s limit without an answer is not reached,
    # though the whole setup takes longer than that.
    cfg = digits_cfg(tmp_path / "a", "fedavg", clients_per_round=4, rounds=1)
    grid = LocalGrid(4, setup_delay={0: 0.3, 1: 0.6, 2: 0.9, 3: 1.2})
    folder, _ = serve(grid, cfg, setup_timeout=0.5)
    assert metrics(folder)[0]["missing_replies"] == []
    # A node that never answers: the run goes on without its partition after the limit.
    cfg = digits_cfg(tmp_path / "b", "fedavg", clients_per_round=4, rounds=1)
    folder, _ = serve(LocalGrid(4, setup_delay={3: math.inf}), cfg, setup_timeout=0.3)
    assert metrics(folder)[0]["missing_replies"] == [3]
    # None answers: one line that names the partitions.
    cfg = digits_cfg(tmp_path / "c", "fedavg", clients_per_round=4, rounds=1)
    silent = LocalGrid(4, setup_delay=dict.fromkeys(range(4), math.inf))
    with pytest.raises(FedskewError, match=r"partitions 0-3 still starting"):
        serve(silent, cfg, setup_timeout=0.3)


class FailingSetupGrid(LocalGrid):
    """Every node answers the setup with an error, as a ClientApp that cannot import
    fedskew does (Flower's runtime turns the exception into the reply's error)."""

    def deliver(self, msg):
        reason = "<class 'ModuleNotFoundError'>:<'No module named 'fedskew''>"
        return FlowerMessage(Error(code=0, reason=reason), reply_to=msg)


def test_no_connected_supernode_is_told_apart_from_a_failed_setup(tmp_path, monkeypatch):
    """After a SuperLink restart its SuperNodes are gone: the error says no node is connected
    (and why that happens), not that nodes were slow to answer."""
    monkeypatch.setattr(flower_server, "POLL_SECONDS", 0.05)
    cfg = digits_cfg(tmp_path / "none", "fedavg", num_clients=2, clients_per_round=2, rounds=1)
    nobody = LocalGrid(2)
    nobody.contexts.clear()
    with pytest.raises(FedskewError) as info:
        serve(nobody, cfg, node_wait=0.2)
    message = str(info.value)
    assert message.startswith("no SuperNode is connected to the SuperLink (waited 0 s: node-wait)")
    assert "SuperNodes do not reconnect to a restarted SuperLink" in message
    assert "setup" not in message and "\n" not in message
    assert not (tmp_path / "none").exists()  # nothing written

    cfg = digits_cfg(tmp_path / "fail", "fedavg", num_clients=2, clients_per_round=2, rounds=1)
    with pytest.raises(FedskewError) as info:
        serve(FailingSetupGrid(2), cfg, setup_timeout=5.0)
    assert str(info.value).startswith(
        "every SuperNode that answered failed the setup message; node 1000: "
        "<class 'ModuleNotFoundError'>"
    )
    assert "(and 1 more)" in str(info.value) and "fedskew[flower] installed" in str(info.value)

    cfg = digits_cfg(tmp_path / "ids", "fedavg", num_clients=2, clients_per_round=2, rounds=1)
    elsewhere = LocalGrid(2)
    for n, context in enumerate(elsewhere.contexts.values()):
        context.node_config["partition-id"] = 7 + n  # partitions of a bigger federation
    with pytest.raises(FedskewError, match="2 SuperNodes answered the setup but none holds a "
                       r"partition of this run \(0 \.\. 1\)"):  # fmt: skip
        serve(elsewhere, cfg, setup_timeout=5.0)

    cfg = digits_cfg(tmp_path / "mute", "fedavg", num_clients=2, clients_per_round=2, rounds=1)
    silent = LocalGrid(2, setup_delay=dict.fromkeys(range(2), math.inf))
    with pytest.raises(FedskewError, match=r"^2 SuperNodes are connected but none answered the "
                       r"setup message within 0 s \(partitions 0-1 still starting\)"):  # fmt: skip
        serve(silent, cfg, setup_timeout=0.2)


def test_setup_limit_grows_with_the_load(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert setup_limit(None) == flower_server.SETUP_TIMEOUT_SECONDS  # idle: the base
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 4.0, 4.0))
    assert setup_limit(None) == 2 * flower_server.SETUP_TIMEOUT_SECONDS  # load 4 on 2 cores
    assert setup_limit(30.0) == 30.0  # setup-timeout wins


def test_server_options_from_the_run_config():
    assert server_options({}) == {"node_wait": 120.0, "setup_timeout": None}
    got = server_options({"node-wait": 5, "setup-timeout": 600.0, "rounds": 3})
    assert got == {"node_wait": 5.0, "setup_timeout": 600.0}
    assert server_options({"setup-timeout": 0}) == {"node_wait": 120.0, "setup_timeout": None}
    for bad in ({"node-wait": -1}, {"setup-timeout": math.nan}, {"setup-timeout": "x"},
                {"node-wait": True}):  # fmt: skip
        with pytest.raises(UsageError):
            server_options(bad)


# --------------------------------------------------------------------------- processes


def orphan_sleeper(env: dict[str, str]) -> int:
    """A process whose parent has exited (as a Ray worker whose raylet was shut down)."""
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_only_processes_tagged_by_the_run_are_ended():
    tag = uuid.uuid4().hex
    mine = orphan_sleeper({**os.environ, "FEDSKEW_SIMULATION_TAG": tag})
    other = orphan_sleeper({**os.environ, "FEDSKEW_SIMULATION_TAG": "another run"})
    try:
        found = tagged_processes("FEDSKEW_SIMULATION_TAG", tag)
        assert [pid for pid, _ in found] == [mine]
        assert end_processes(found, grace=2.0) == [mine]
        assert tagged_processes("FEDSKEW_SIMULATION_TAG", tag) == []
        assert tagged_processes("FEDSKEW_SIMULATION_TAG", "another run")  # left alone
        # A pid whose start time differs is another process by now: never signalled.
        assert end_processes([(other, -1)]) == []
    finally:
        os.kill(other, 9)


def test_only_flowers_environment_of_this_run_is_removed(tmp_path, monkeypatch):
    """The ServerApp deletes the environment Flower installed for its run (Flower 1.42 would
    delete it within its 5 s exit window and lose the run's status), and nothing else."""
    from fedskew.apps.flower.server import remove_runtime_environment

    envs = tmp_path / "flwr" / "runtime-envs"
    for name in ("123", "456"):
        (envs / name / "lib").mkdir(parents=True)
    mine = tmp_path / "venvs" / "123"
    mine.mkdir(parents=True)
    monkeypatch.setenv("VIRTUAL_ENV", str(mine))  # the operator's own, named like a run
    remove_runtime_environment(123)
    assert mine.is_dir()
    monkeypatch.setenv("VIRTUAL_ENV", str(envs / "456"))  # another run's
    remove_runtime_environment(123)
    assert (envs / "456").is_dir()
    monkeypatch.setenv("VIRTUAL_ENV", str(envs / "123"))
    remove_runtime_environment(123)
    assert not (envs / "123").exists() and (envs / "456").is_dir()
    monkeypatch.delenv("VIRTUAL_ENV")
    remove_runtime_environment(456)
    assert (envs / "456").is_dir()


# --------------------------------------------------------------------------- simulation


def test_a_simulation_passes_its_experiment_through_the_run_config(tmp_path):
    """--engine flower-sim submits the experiment as Flower run config: the ServerApp reads
    back the same configuration (tables, lists, unset values and a partition file in the
    output folder included)."""
    import dataclasses

    partition = tmp_path / "parts" / "p.json"
    partition.parent.mkdir()
    partition.write_text(json.dumps([[0, 1, 2], [3, 4, 5]]))
    cfg = build_config({}, dict(
        algorithm="fedfm", params={"lam": 5.0, "start_round": 1, "anchor_agg": "uniform"},
        partition="dirichlet", partition_params={"alpha": 0.3}, num_clients=2,
        participation=None, clients_per_round=2, rounds=3, lr=0.01, seed=7, track="",
        out_dir=str(tmp_path), partition_file=str(partition), engine="flower-sim",
    ))  # fmt: skip
    run_config = {**simulation_run_config(cfg, tmp_path.resolve()), "name": "n"}
    declared = set(app_declared_keys())
    assert set(run_config) <= declared  # flwr refuses keys the app does not declare
    assert run_config["partition-file"] == "parts/p.json"
    assert run_config["params"] == "lam=5.0 start_round=1 anchor_agg=uniform"
    back = config_from_run_config(run_config, tmp_path.resolve())
    for f in dataclasses.fields(cfg):
        if f.name not in ("engine", "out_dir", "name", "partition_file", "quiet", "workers"):
            assert getattr(back, f.name) == getattr(cfg, f.name), f.name
    assert Path(back.partition_file) == partition.resolve()
    with pytest.raises(UsageError, match="reads files only inside the output folder"):
        simulation_run_config(dataclasses.replace(cfg, partition_file="/etc/passwd"), tmp_path)
    spaced = dataclasses.replace(cfg, params={"note": "two words"})
    with pytest.raises(UsageError, match="does not read back the same"):
        simulation_run_config(spaced, tmp_path)


def app_declared_keys() -> list[str]:
    import tomllib

    text = (Path(__file__).resolve().parents[1] / "flower" / "pyproject.toml").read_text()
    return list(tomllib.loads(text)["tool"]["flwr"]["app"]["config"])


# Minutes on 2 busy cores (a SuperLink, Ray and its actors per run): `pytest -m slow`.
@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm,params", [("fedcme", {}), ("fedfm", {"start_round": 1, "lam": 5})]
)
def test_flower_simulation_equals_inprocess(tmp_path, algorithm, params):
    """`--engine flower-sim` on Flower's Simulation Runtime (flwr run on a SuperLink in
    simulation mode, Ray): the in-process curve, the rounds reported as they come, and a run
    folder that says flower-sim."""
    rounds: list[dict] = []
    starts: list[int] = []
    cfg = digits_cfg(tmp_path / "sim", algorithm, params=params, rounds=2, name=algorithm,
                     engine="flower-sim")  # fmt: skip
    folder, summary = run_simulation(cfg, on_round=rounds.append, on_start=starts.append)
    assert folder == (tmp_path / "sim" / algorithm).resolve()
    assert starts == [0] and [r["round"] for r in rounds] == [1, 2]
    assert rounds == metrics(folder)
    assert json.loads((folder / "config.json").read_text())["engine"] == "flower-sim"
    cfg = digits_cfg(tmp_path / "ip", algorithm, params=params, rounds=2, name=algorithm)
    folder_ip, summary_ip = run(cfg)
    assert_same_curves(metrics(folder_ip), metrics(folder))
    assert summary["final_accuracy"] == summary_ip["final_accuracy"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_failed_simulation_leaves_no_process(tmp_path, monkeypatch):
    """A Flower simulation that fails at the setup (Ray's actors still starting: no answer
    within 0.01 s) says why in one line and ends every process it started: the SuperLink,
    the simulation process, Ray's."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("FEDSKEW_TEST_MARK", mark)  # inherited by whatever the run starts
    seen: set[int] = set()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.update(pid for pid, _ in tagged_processes("FEDSKEW_TEST_MARK", mark))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    cfg = digits_cfg(tmp_path, "fedavg", num_clients=2, clients_per_round=2, rounds=1,
                     engine="flower-sim")  # fmt: skip
    try:
        with pytest.raises(FedskewError, match=r"Flower run \d+ failed: 2 SuperNodes are "
                           "connected but none answered the setup message"):  # fmt: skip
            run_simulation(cfg, setup_timeout=0.01)
    finally:
        done.set()
        sampler.join()
    left = tagged_processes("FEDSKEW_TEST_MARK", mark)
    end_processes(left)  # so that a failure here leaves nothing behind either
    assert len(seen) >= 3  # the SuperLink, the simulation process, Ray's: all were there
    assert left == []


# --------------------------------------------------------------------------- resume


def test_deployed_run_resumes_through_the_run_config(tmp_path, monkeypatch):
    """A deployed run killed after round 2 continues with `--run-config resume=DIR` and
    ends with the same curve as an uninterrupted in-process run."""

    class Killed(Exception):
        pass

    def kill_after_two(record: dict) -> None:
        if record["round"] == 2:
            raise Killed

    cfg = digits_cfg(tmp_path / "fl", "fedavg", rounds=4, name="dep")
    cfg.engine = "flower"
    with pytest.raises(Killed):
        serve(LocalGrid(4), cfg, on_round=kill_after_two)
    unfinished = tmp_path / "fl" / "dep.incomplete"
    assert len(metrics(unfinished)) == 2

    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path / "fl"))
    context = Context(run_id=2, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"resume": "dep.incomplete", "rounds": 99})  # fmt: skip
    _server_main(LocalGrid(4), context)
    finished = tmp_path / "fl" / "dep"
    reference, _ = run(digits_cfg(tmp_path / "ip", "fedavg", rounds=4))
    assert_same_curves(metrics(reference), metrics(finished))

    # fedskew run --resume refuses a deployed run rather than continuing it in-process.
    from fedskew.apps.cli import main

    cfg2 = digits_cfg(tmp_path / "fl2", "fedavg", rounds=3, name="dep2")
    cfg2.engine = "flower"
    with pytest.raises(Killed):
        serve(LocalGrid(4), cfg2, on_round=kill_after_two)
    assert main(["run", "--resume", str(tmp_path / "fl2" / "dep2.incomplete"), "-q"]) == 2


def test_the_flower_app_config_declares_fedskew_keys_with_fedskew_defaults(tmp_path):
    """flwr refuses --run-config keys the app does not declare: each declared key must be
    one the ServerApp understands, and leaving it as declared must run fedskew's defaults
    (only the app's small default federation differs)."""
    import dataclasses
    import tomllib

    declared = tomllib.loads(
        (Path(__file__).resolve().parents[1] / "flower" / "pyproject.toml").read_text(
            encoding="utf-8"
        )
    )
    declared = declared["tool"]["flwr"]["app"]["config"]
    experiment = {k: v for k, v in declared.items() if k not in SERVER_KEYS}
    cfg = config_from_run_config(experiment, tmp_path)
    default = ExperimentConfig()
    differs = {
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)
    }
    assert differs == {"num_clients", "rounds", "engine", "out_dir"}
    for key in ("grad-clip", "precision", "on-divergence", "partition-file", "local-risk-every"):
        assert key in declared
    # And the other way round: every option of `fedskew run` is declared, unless its option
    # metadata says flower=False with a reason; a new option fails here until it is one or
    # the other.
    names = {k.replace("-", "_") for k in declared}
    for f in dataclasses.fields(ExperimentConfig):
        if f.metadata.get("flower", True):
            assert f.name in names, f"flower/pyproject.toml does not declare {f.name}"
        else:
            assert f.name not in names and f.metadata["flower_reason"], f.name
    assert NOT_IN_RUN_CONFIG == {
        f.name: f.metadata["flower_reason"]
        for f in dataclasses.fields(ExperimentConfig)
        if f.metadata.get("flower") is False
    }


# --------------------------------------------------------------------------- the streamed log


def _server_main_in(root: Path, monkeypatch, grid_nodes: int = 2, **run_config):
    from flower_log import flower_log

    monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(root))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config)  # fmt: skip
    return flower_log(lambda: _server_main(LocalGrid(grid_nodes), context))


@pytest.mark.parametrize(
    "bad,said",
    [
        ({"rounds": -1}, "rounds must be a positive integer"),
        ({"out-dir": "/srv/elsewhere"}, "run config 'out-dir' must be a path relative"),
        ({"node-wait": -3}, "node-wait' must be a number of seconds >= 0"),
    ],
)
def test_a_refused_run_config_is_one_line_in_the_streamed_log(tmp_path, monkeypatch, bad, said):
    """Flower logs a ServerApp's exception with its traceback: for a fedskew error the
    user reads only fedskew's one line (issue 50: 20 lines of traceback above it)."""
    text, raised = _server_main_in(tmp_path, monkeypatch, **bad)
    assert isinstance(raised, UsageError) and said in str(raised)
    assert "Traceback" not in text and 'File "' not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and f"fedskew: {raised}" in lines[0], text


def test_a_fault_that_is_not_a_fedskew_error_keeps_its_traceback(tmp_path, monkeypatch):
    """Only fedskew's own errors lose the traceback: a bug must still show where it is."""

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(flower_server, "serve", broken)
    text, raised = _server_main_in(tmp_path, monkeypatch, rounds=1)
    assert isinstance(raised, ZeroDivisionError)
    assert "Traceback" in text and "Exit Code" in text


def test_the_streamed_log_has_a_line_per_round_and_a_readable_last_line(tmp_path, monkeypatch):
    """One line per round with the accuracy in % (and epsilon under DP), and a last line
    that says the final accuracy in % and where the run folder is (issue 48: no round
    lines, and 'final accuracy 0.9388888888888889')."""
    small = {"num-clients": 2, "clients-per-round": 2, "local-epochs": 1, "quiet": True}
    text, raised = _server_main_in(tmp_path, monkeypatch, rounds=2, name="r", **small)
    assert raised is None, text
    rounds = [line for line in text.splitlines() if "round " in line and "/2" in line]
    assert len(rounds) == 2, text
    for n, line in enumerate(rounds, start=1):
        assert re.search(rf"round {n}/2, accuracy \d{{1,3}}\.\d\d %$", line), line
    last = text.strip().splitlines()[-1]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    final = f"{100 * summary['final_accuracy']:.2f} %"
    assert re.search(r"finished after 2 rounds: final accuracy \d+\.\d\d %", last), last
    assert final in last and str((tmp_path / "r").resolve()) in last, last
    assert "0." + str(summary["final_accuracy"])[2:8] not in last  # no raw fraction

    dp = {"dp": "central", "dp-clip": 1.0, "dp-noise": 1.0}
    text, raised = _server_main_in(tmp_path, monkeypatch, rounds=1, name="dp", **small, **dp)
    assert raised is None, text
    assert re.search(r"round 1/1, accuracy \d+\.\d\d %, epsilon \d", text), text
    assert re.search(r"central DP epsilon \d[^ ]* at delta", text.strip().splitlines()[-1])


# --------------------------------------------------------------------------- nodes' provenance


def test_each_nodes_torch_fedskew_and_device_are_recorded_and_differences_warned(tmp_path, caplog):
    """processes.jsonl holds what every node computes with, and the server warns when a
    node's torch, fedskew or device differs from its own (issue 48: only the server's
    torch was recorded, while the nodes ran another)."""
    from fedskew.engines.flower_codec import STRINGS
    from fedskew.version import __version__

    def other_torch(content) -> None:
        content.config_records[STRINGS]["torch"] = "2.14.1+cu130"

    def older_fedskew(content) -> None:  # says nothing of itself
        for key in ("torch", "fedskew", "device", "device_name", "python"):
            del content.config_records[STRINGS][key]

    cfg = digits_cfg(tmp_path, "fedavg", num_clients=3, clients_per_round=3, rounds=1,
                     local_epochs=1, name="prov")  # fmt: skip
    cfg.engine = "flower"
    grid = LocalGrid(3, corrupt={(-1, 1): other_torch, (-1, 2): older_fedskew})
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, _ = serve(grid, cfg)
    lines = [json.loads(line) for line in (folder / "processes.jsonl").read_text().splitlines()]
    nodes = {n["partition"]: n for n in lines[0]["nodes"]}
    assert sorted(nodes) == [0, 1, 2]
    assert nodes[0]["torch"] == torch.__version__ and nodes[0]["fedskew"] == __version__
    assert nodes[0]["device"] == "cpu" and nodes[0]["python"] and nodes[0]["node"] == 1000
    assert nodes[1]["torch"] == "2.14.1+cu130" and nodes[2]["torch"] is None
    warned = [
        r.getMessage() for r in caplog.records if "SuperNodes of partitions" in r.getMessage()
    ]
    assert any("partitions 1 run torch 2.14.1+cu130, the server " + torch.__version__ in w
               for w in warned), warned  # fmt: skip
    assert any("partitions 2 run fedskew unknown" in w for w in warned), warned
    assert not any("partitions 0" in w for w in warned), warned
