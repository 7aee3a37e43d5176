"""`fedskew report`: a Markdown and a self-contained HTML report rebuilt from run folders,
with the optional parts (other metrics, t-SNE) when the folders have them and "not recorded"
where they do not say."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.report.document import Heading, Image, Para, Table, to_html, to_markdown
from fedskew.report.runs import find_runs, method_label
from fedskew.runs.loop import run


def _png() -> bytes:
    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    fig.subplots().scatter(np.arange(5), np.arange(5))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """2 methods x 2 seeds x 2 rounds on digits, named as fedskew compare names runs."""
    root = tmp_path_factory.mktemp("grid")
    for seed in (0, 1):
        for name, algorithm in (("fedavg", "fedavg"), ("prox", "fedprox")):
            cfg = ExperimentConfig(
                algorithm=algorithm, num_clients=4, clients_per_round=2, rounds=2,
                local_epochs=1, seed=seed, out_dir=str(root), name=f"{name}-s{seed}",
                quiet=True,
            )  # fmt: skip
            run(cfg)
    # What another part of fedskew may add to a run folder: a t-SNE picture, a metric.
    (root / "prox-s0" / "tsne.png").write_bytes(_png())
    path = root / "prox-s1" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "feature_nmi": 0.5}) + "\n" for r in rows))
    # A run from before processes.jsonl: its provenance is "not recorded", not invented.
    (root / "fedavg-s1" / "processes.jsonl").unlink()
    return root


def test_report_renders_markdown_and_self_contained_html(grid, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(grid), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()

    # Markdown: its pictures beside it, every link resolving.
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert {Path(x).name for x in links} >= {"curves-all.png", "partition-all-s0.png"}
    assert all((out / x).is_file() for x in links)
    assert any("tsne.png" in x for x in links)
    for heading in (
        "## Results",
        "## Curves",
        "## Partition",
        "## Configuration",
        "## t-SNE of test features",
        "## Where each run's numbers came from",
    ):
        assert heading in md, heading
    assert "| fedavg | 2 |" in md and "| prox | 2 |" in md
    assert "feature NMI" in md and "0.5000 (1 seed)" in md
    assert "r1-2: not recorded" not in md and "not recorded (no processes.jsonl)" in md
    assert "identical across methods in 2 of 2" in md

    # HTML: one file, every picture embedded, nothing fetched from elsewhere.
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(images) == len(links)
    assert all(src.startswith("data:image/png;base64,") for src in images)
    for src in images:
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<table>" in page and "prox" in page


def test_report_of_one_run_folder(grid, tmp_path):
    assert main(["report", str(grid / "fedavg-s0"), "-o", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "1 method(s) (fedavg)" in md and "vs fedavg" not in md


def test_runs_are_found_and_labelled(grid):
    records = find_runs(grid)
    assert sorted((r.method, r.seed) for r in records) == [
        ("fedavg", 0), ("fedavg", 1), ("prox", 0), ("prox", 1),
    ]  # fmt: skip
    assert method_label("fedavg-digits-dirichlet-s3-20250101-000000", {"algorithm": "fedavg",
                        "seed": 3, "params": {"mu": 1}}) == "fedavg mu=1"  # fmt: skip


def test_document_renders_both_ways():
    blocks = [
        Heading(1, "T"),
        Para("a `code` <b> and **bold**"),
        Table(["x", "y|z"], [["1", "2"]]),
        Image("p.png", b"\x89PNG...", "a caption"),
    ]
    md, files = to_markdown(blocks, "files")
    assert "![a caption](files/p.png)" in md and files == {"p.png": b"\x89PNG..."}
    assert "y\\|z" in md
    page = to_html(blocks, "T")
    assert "<code>code</code>" in page and "&lt;b&gt;" in page and "<strong>bold</strong>" in page
    assert "data:image/png;base64," in page


def test_report_of_a_grid_with_settings(grid, tmp_path):
    """Run folders one level down are one setting per subfolder: an overview table with the
    settings across, and each setting's own tables, curves and partition."""
    import shutil

    root = tmp_path / "grid"
    for setting in ("beta0.5", "iid"):
        for folder in ("fedavg-s0", "prox-s0"):
            shutil.copytree(grid / folder, root / setting / folder)
    assert main(["report", str(root)]) == 0
    md = (root / "report.md").read_text()
    # 2-round runs under the default last = 10: the label says what was averaged.
    assert "Overview: mean of the last 2 evaluated rounds (%)" in md
    assert "| method | beta0.5 | iid |" in md
    assert md.count("### Setting beta0.5") == 1 and "curves-iid.png" in md
    assert (root / "report_files" / "partition-beta0.5-s0.png").is_file()


def test_partition_check_reads_the_digest_config_json_recorded(grid, tmp_path):
    """partition.npz is large and kept out of shared results; the digest config.json records
    at the start of a run lets the report check the partitions without it, and still see a
    difference."""
    import shutil

    from fedskew.data.partition import load_partition, partition_digest

    copy = tmp_path / "grid"
    shutil.copytree(grid, copy)
    for folder in sorted(copy.iterdir()):
        resolved = json.loads((folder / "config.json").read_text())["resolved"]
        on_disk = partition_digest(load_partition(folder / "partition.npz")[0])
        assert resolved["partition_digest"] == on_disk
        (folder / "partition.npz").unlink()
    assert main(["report", str(copy), "-o", str(tmp_path / "a")]) == 0
    md = (tmp_path / "a" / "report.md").read_text()
    assert "identical across methods in 2 of 2" in md

    # A folder from before the digest was recorded: that group is checked only partly.
    path = copy / "prox-s1" / "config.json"
    config = json.loads(path.read_text())
    del config["resolved"]["partition_digest"]
    path.write_text(json.dumps(config))
    # One whose recorded partition differs is named.
    path = copy / "prox-s0" / "config.json"
    config = json.loads(path.read_text())
    config["resolved"]["partition_digest"] = "0123456789abcdef"
    path.write_text(json.dumps(config))
    assert main(["report", str(copy), "-o", str(tmp_path / "b")]) == 0
    md = (tmp_path / "b" / "report.md").read_text()
    assert "identical across methods in 0 of 2" in md
    assert (
        "in 1 other group(s), identical among the runs that record it (1 run(s) not recorded)"
    ) in md
    assert "DIFFERENT in the setting seed 0" in md


def test_cost_table_names_the_machines_behind_its_seconds(grid, tmp_path):
    """Seconds per round measured on different machines are not comparable: each row names
    its machine, and a row whose seeds ran on more than one says 'mixed'."""
    import shutil

    copy = tmp_path / "grid"
    shutil.copytree(grid, copy)
    path = copy / "prox-s1" / "processes.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    cpu = lines[0]["cpu"]
    path.write_text("".join(json.dumps({**p, "cpu": "Other CPU 9000"}) + "\n" for p in lines))
    assert main(["report", str(copy), "-o", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    prox = next(x for x in md.splitlines() if x.startswith("| prox |") and "KiB" in x)
    assert prox.endswith(f"(mixed: {cpu}, Other CPU 9000) |")
    # fedavg-s1 has no processes.jsonl: its machine is not recorded, and the row says so.
    fedavg = next(x for x in md.splitlines() if x.startswith("| fedavg |") and "KiB" in x)
    assert fedavg.endswith(f"(mixed: {cpu}, not recorded) |")
