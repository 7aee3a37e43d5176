"""partition_version: run folders made when dirichlet and shards placed the classes in
index order (before the key existed) read back, rebuild, resume and hash as the runs they
were, under the schemes' names of today (dirichlet-niidbench, shards-fedavg); new
configurations record version 2 and hash their schemes apart from the old ones."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fedskew.assembly.prepare import build_partition, load_experiment_data
from fedskew.config import (
    EXECUTION_ONLY,
    LEGACY,
    MEASUREMENT_ONLY,
    ExperimentConfig,
    build_config,
    config_differences,
    config_hash,
)
from fedskew.core.errors import UsageError
from fedskew.data.partition import partition_digest
from fedskew.runs.folder import saved_config
from fedskew.runs.loop import run

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_clients=4, clients_per_round=2, rounds=3, local_epochs=1, quiet=True, workers=0)
# {today's name: the name a folder of partition version 1 recorded for the same scheme}
OLD_NAMES = {"dirichlet-niidbench": "dirichlet", "shards-fedavg": "shards"}


class Killed(Exception):
    pass


def curves(folder: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["round"], r["accuracy"], r["loss"], r.get("train_loss")) for r in rows]


def old_hash(values: dict) -> str:
    """The configuration hash as fedskew computed it before partition_version existed:
    sha256 of the sorted JSON of every key but the execution and measurement ones and but
    those at their LEGACY value, first 16 digits."""
    skip = set(EXECUTION_ONLY) | set(MEASUREMENT_ONLY)
    before = {k: v for k, v in LEGACY.items() if k != "partition_version"}
    kept = {
        k: v
        for k, v in values.items()
        if k not in skip and not (k in before and v == before[k]) and k != "partition_version"
    }
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def as_old_folder(config: dict) -> dict:
    """What a folder written before partition_version existed held for the same run."""
    old = {k: v for k, v in config.items() if k != "partition_version"}
    old["partition"] = OLD_NAMES.get(old["partition"], old["partition"])
    return old


@pytest.mark.parametrize(
    ("scheme", "params"),
    [("dirichlet-niidbench", {"min_size": 5}), ("shards-fedavg", {"shards_per_client": 3})],
)
def test_a_folder_from_before_the_version_resumes_with_its_partition(tmp_path, scheme, params):
    """The folder names the scheme as it was then ("dirichlet", "shards") and has no
    partition_version: it reads back as today's dirichlet-niidbench / shards-fedavg, its
    checkpoint's configuration hash still matches, the partition rebuilt from its
    configuration is its partition.npz, and the resumed run ends with the metrics of an
    uninterrupted one."""
    setting = dict(TINY, partition=scheme, partition_params=params)
    reference, _ = run(ExperimentConfig(**setting, out_dir=str(tmp_path / "r")))

    def kill(record):
        if record["round"] == 1:
            raise Killed

    with pytest.raises(Killed):
        run(ExperimentConfig(**setting, out_dir=str(tmp_path / "old")), on_round=kill)
    (unfinished,) = (tmp_path / "old").iterdir()
    path = unfinished / "config.json"
    config = as_old_folder(json.loads(path.read_text()))
    path.write_text(json.dumps(config))

    cfg = saved_config(unfinished)
    assert cfg.partition == scheme and cfg.partition_version == 1
    assert config_hash(cfg) == old_hash({k: v for k, v in config.items() if k != "resolved"})
    # Today's scheme of the old name is another partition: the folder would not resume
    # with it ("the saved partition differs from the one rebuilt from its config").
    dataset = load_experiment_data(cfg)
    values = {k: v for k, v in config.items() if k != "resolved"}
    today = build_config({**values, "partition_version": 2}, {})
    assert today.partition == OLD_NAMES[scheme]
    saved_digest = config["resolved"]["partition_digest"]
    assert partition_digest(build_partition(cfg, dataset)) == saved_digest
    assert partition_digest(build_partition(today, dataset)) != saved_digest

    folder, _ = run(cfg, resume=unfinished)
    assert curves(folder) == curves(reference)


def test_new_configurations_record_version_2_and_hash_the_schemes_apart():
    default = build_config({}, {})
    assert default.partition == "dirichlet" and default.partition_version == 2
    assert default.to_dict()["partition_version"] == 2
    for today, old in OLD_NAMES.items():
        kept = build_config({"partition": today}, {})
        new = build_config({"partition": old}, {})
        # The kept scheme hashes as the folders of version 1 did; the new one apart from it.
        assert config_hash(kept) == old_hash({**kept.to_dict(), "partition": old})
        assert config_hash(new) != config_hash(kept)
        assert config_differences(kept, new) == f"partition: {today!r} there, {old!r} here"
        # Version 1's spelling of the kept scheme is the same configuration.
        assert config_hash(build_config({"partition": old, "partition_version": 1}, {})) == (
            config_hash(kept)
        )
    # Schemes whose meaning did not change keep their hashes.
    for scheme in ("iid", "classes", "niid2", "missing", "quantity"):
        cfg = build_config({"partition": scheme}, {})
        assert config_hash(cfg) == old_hash(cfg.to_dict())
        assert config_hash(cfg) == config_hash(
            build_config({"partition": scheme, "partition_version": 1}, {})
        )


@pytest.mark.parametrize("value", [0, 3, "2x", True, 1.5])
def test_a_bad_partition_version_is_one_line(value):
    with pytest.raises(UsageError) as caught:
        build_config({"partition_version": value}, {})
    assert "\n" not in str(caught.value) and "partition" in str(caught.value)


def committed_folders() -> list[Path]:
    folders = sorted(p.parent for p in ROOT.glob("benchmarks/results/runs/**/config.json"))
    return folders + sorted(p.parent for p in ROOT.glob("reproduction/runs/**/config.json"))


def test_committed_run_folders_read_back_with_the_loop_they_ran(monkeypatch):
    """Every committed run folder was made before partition_version: one that says
    "dirichlet" ran NIID-Bench's loop, and reads back (for its report, a rerun of its grid,
    a resume) as dirichlet-niidbench with the configuration hash it had."""
    import fedskew.config

    # Some folders were computed on a GPU: read them as on the machine that made them.
    monkeypatch.setattr(fedskew.config, "cuda_count", lambda: 1)
    old = []
    for folder in committed_folders():
        config = json.loads((folder / "config.json").read_text())
        if config.get("partition") in OLD_NAMES.values() and "partition_version" not in config:
            old.append((folder, config))
    if not old:
        pytest.skip("no committed run folder predates partition_version")
    for folder, config in old[:: max(1, len(old) // 25)]:
        cfg = saved_config(folder)
        assert cfg.partition == {v: k for k, v in OLD_NAMES.items()}[config["partition"]]
        config.pop("resolved", None)
        assert config_hash(cfg) == old_hash({**cfg.to_dict(), "partition": config["partition"]})


REPRODUCTION_GRIDS = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [*(ROOT / "reproduction").glob("*.toml"), *ROOT.glob("reproduction/runs/*/tuned.json")]
)


@pytest.mark.parametrize("grid_file", REPRODUCTION_GRIDS)
def test_reproduction_grids_plan_what_their_committed_runs_computed(grid_file):
    """The reproduction grids (and the compare file fedskew tune wrote for the tuned
    evaluation) pin dirichlet-niidbench: a rerun of one plans each committed run folder with
    the configuration hash it has (so it is "done before", not "holds a run with another
    configuration"), and so the partition the folder ran with."""
    from fedskew.apps import compare

    file = ROOT / grid_file
    grid = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
    grid.out_dir = ROOT / grid.out_dir
    planned = {r.folder: r for r in compare.plan(grid)}
    committed = [p.parent for p in grid.out_dir.rglob("config.json")]
    if not committed:
        pytest.skip(f"{grid_file} has no committed runs")
    matched = 0
    for folder in committed:
        run_ = planned.get(folder.relative_to(grid.out_dir).as_posix())
        if run_ is None:
            continue  # a run the grid no longer plans
        matched += 1
        assert compare.saved_hash(folder) == config_hash(run_.cfg), folder
    assert matched, f"no committed run of {grid_file} is planned"


@pytest.mark.parametrize(
    "dataset",
    ["digits", pytest.param("cifar10", marks=pytest.mark.slow),
     pytest.param("fmnist", marks=pytest.mark.slow)],
)  # fmt: skip
def test_committed_run_folders_rebuild_the_partition_they_recorded(dataset):
    """Each committed run folder whose config.json recorded its partition's digest gets that
    partition back when it is rebuilt from its configuration (as a report or a resume
    rebuilds it): the folders made with dirichlet before partition_version 2 get NIID-Bench's
    loop. cifar10 and fmnist need their local copies (skipped without; slow: the first load
    decodes the CIFAR-10 JPEG copy)."""
    import dataclasses

    from fedskew.core.errors import FedskewError

    groups: dict[tuple, list[tuple[Path, str]]] = {}
    for folder in committed_folders():
        config = json.loads((folder / "config.json").read_text())
        digest = config.get("resolved", {}).get("partition_digest")
        if digest and config.get("dataset") == dataset:
            cfg = saved_config(folder, {"device": "cpu"})  # a GPU run's folder, read here
            key = (cfg.partition, json.dumps(cfg.partition_params, sort_keys=True),
                   cfg.num_clients, cfg.seed)  # fmt: skip
            groups.setdefault(key, []).append((folder, digest))
    if not groups:
        pytest.skip(f"no committed {dataset} run folder recorded its partition digest")
    first = saved_config(next(iter(groups.values()))[0][0], {"device": "cpu"})
    try:
        data = load_experiment_data(dataclasses.replace(first, download=False))
    except FedskewError as exc:
        pytest.skip(f"{dataset} is not available here: {exc}")
    for items in groups.values():
        cfg = saved_config(items[0][0], {"device": "cpu"})
        rebuilt = partition_digest(build_partition(cfg, data))
        assert {digest for _, digest in items} == {rebuilt}, items[0][0]


def test_a_grid_report_says_which_partition_version_old_folders_ran(tmp_path):
    """The comparison's configuration table fills a key an old folder lacks with the value
    it ran with (config.LEGACY), not today's default: partition_version 1, which makes its
    "dirichlet" NIID-Bench's loop."""
    import shutil

    from fedskew.apps.cli import main

    grid = tmp_path / "fedcme-fmnist"
    shutil.copytree(ROOT / "reproduction" / "runs" / "fedcme-fmnist", grid)
    file = ROOT / "reproduction" / "fedcme-fmnist.toml"
    assert main(["compare", "-c", str(file), "-o", str(grid), "--report-only"]) == 0
    text = (grid / "comparison.md").read_text()
    assert "| partition | dirichlet |" in text and "| partition_version | 1 |" in text
