"""The Flower engine: codec, reply checks, equivalence with the in-process engine, faults.

Most tests drive the real ServerApp logic (``serve``) and the real ClientApp through an
in-memory Grid that calls the ClientApp directly with one persistent Context per node, so
they run in seconds; ``test_ray_simulation_equals_inprocess`` runs Flower's own simulation
engine (Ray). Real SuperLink/SuperNode deployments are in test_flower_deployment.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedskew.config import ExperimentConfig, build_config  # noqa: E402
from fedskew.engine.flower_codec import (  # noqa: E402
    ARRAYS,
    RejectedReply,
    arrays_record,
    check_reply,
    decode,
    encode,
)
from fedskew.errors import UsageError  # noqa: E402
from fedskew.experiment import run  # noqa: E402
from fedskew.flower_app import (  # noqa: E402
    client_app,
    config_from_run_config,
    serve,
)
from fedskew.protocol import Message  # noqa: E402


class LocalGrid(Grid):
    """Delivers messages to the ClientApp in this process, one Context per node.

    ``drop`` lists (round, partition id) pairs whose reply is lost (round -1 is the setup);
    ``corrupt`` maps such pairs to a function applied to the reply content.
    """

    def __init__(self, num_nodes: int, drop=(), corrupt=None) -> None:
        # What Flower's runtime sets in a ServerApp process before messages are made.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.contexts = {
            1000 + pid: Context(
                run_id=1,
                node_id=1000 + pid,
                node_config={"partition-id": pid, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for pid in range(num_nodes)
        }
        self.drop = set(drop)
        self.corrupt = dict(corrupt or {})
        self.sent_to: list[int] = []

    def set_run(self, run) -> None:  # pragma: no cover - not used by fedskew
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None) -> Iterable[FlowerMessage]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.sent_to.append(node)
            context = self.contexts[node]
            reply = client_app(msg, context)
            key = (int(msg.metadata.group_id or -1), node - 1000)
            if key in self.drop:
                continue
            if key in self.corrupt:
                self.corrupt[key](reply.content)
            replies.append(reply)
        return replies


def digits_cfg(tmp_path: Path, algorithm: str, **extra) -> ExperimentConfig:
    values = dict(
        algorithm=algorithm, num_clients=4, clients_per_round=3, rounds=3, local_epochs=2,
        out_dir=str(tmp_path), quiet=True,
    )  # fmt: skip
    values.update(extra)
    return build_config({}, values)


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


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
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text('algorithm = "fedprox"\nrounds = 7\n[params]\nmu = 0.1\n')
    cfg = config_from_run_config(
        {
            "config-file": str(cfg_file),
            "num-clients": 5,
            "clients-per-round": "",
            "params": "mu=0.5",
            "partition-params": "beta=0.3",
            "name": "",
        }
    )
    assert cfg.algorithm == "fedprox" and cfg.rounds == 7 and cfg.num_clients == 5
    assert cfg.params == {"mu": 0.5} and cfg.partition_params == {"beta": 0.3}
    assert cfg.engine == "flower" and cfg.name is None
    with pytest.raises(UsageError):
        config_from_run_config({"params": "mu"})
    with pytest.raises(UsageError):
        config_from_run_config({"no-such-key": 1})


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
        record = content.array_records[ARRAYS]
        arrays = {k: torch.from_numpy(v.numpy().copy()) for k, v in record.items()}
        first = next(iter(arrays))
        arrays[first][...] = math.nan
        content[ARRAYS] = arrays_record(arrays)

    def reshape(content: RecordDict) -> None:
        record = content.array_records[ARRAYS]
        arrays = {k: torch.from_numpy(v.numpy().copy()) for k, v in record.items()}
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


def test_two_nodes_claiming_one_partition_is_an_error(tmp_path):
    cfg = digits_cfg(tmp_path, "fedavg")
    grid = LocalGrid(4)
    grid.contexts[1003].node_config["partition-id"] = 0
    with pytest.raises(UsageError, match="both hold partition 0"):
        serve(grid, cfg)


# --------------------------------------------------------------------------- Ray


def test_ray_simulation_equals_inprocess(tmp_path):
    """Flower's own simulation engine (Ray): the four methods in one simulation, each
    against its in-process run."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation as flower_simulation

    cases = [
        ("fedavg", {}),
        ("fedcme", {}),
        ("fedfm", {"start_round": 1, "lam": 5}),
        ("fedacd", {}),
    ]
    folders: dict[str, Path] = {}
    errors: list[BaseException] = []
    app = ServerApp()

    @app.main()
    def _main(grid, context) -> None:
        try:
            for algorithm, params in cases:
                cfg = digits_cfg(tmp_path / "sim", algorithm, params=params, rounds=2,
                                 name=algorithm)  # fmt: skip
                folders[algorithm], _ = serve(grid, cfg)
        except BaseException as exc:
            errors.append(exc)

    flower_simulation(
        server_app=app,
        client_app=client_app,
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    assert not errors, errors
    for algorithm, params in cases:
        cfg = digits_cfg(tmp_path / "ip", algorithm, params=params, rounds=2, name=algorithm)
        folder_ip, _ = run(cfg)
        assert_same_curves(metrics(folder_ip), metrics(folders[algorithm]))


# --------------------------------------------------------------------------- resume


def test_deployed_run_resumes_through_the_run_config(tmp_path):
    """A deployed run killed after round 2 continues with `--run-config resume=DIR` and
    ends with the same curve as an uninterrupted in-process run."""
    from fedskew.flower_app import _server_main

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

    context = Context(run_id=2, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"resume": str(unfinished), "rounds": 99})  # fmt: skip
    _server_main(LocalGrid(4), context)
    finished = tmp_path / "fl" / "dep"
    reference, _ = run(digits_cfg(tmp_path / "ip", "fedavg", rounds=4))
    assert_same_curves(metrics(reference), metrics(finished))

    # fedskew run --resume refuses a deployed run rather than continuing it in-process.
    from fedskew.cli import main

    cfg2 = digits_cfg(tmp_path / "fl2", "fedavg", rounds=3, name="dep2")
    cfg2.engine = "flower"
    with pytest.raises(Killed):
        serve(LocalGrid(4), cfg2, on_round=kill_after_two)
    assert main(["run", "--resume", str(tmp_path / "fl2" / "dep2.incomplete"), "-q"]) == 2
