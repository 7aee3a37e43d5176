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
from fedskew.report.document import (
    Bold,
    Heading,
    Image,
    Mono,
    Para,
    Table,
    to_html,
    to_markdown,
)
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
        Para(["a ", Mono("code"), " <b> and ", Bold("bold")]),
        Table(["x", "y|z"], [["1", "2"]]),
        Image("p.png", b"\x89PNG...", "a caption"),
    ]
    md, files = to_markdown(blocks, "files")
    assert "![a caption](files/p.png)" in md and files == {"p.png": b"\x89PNG..."}
    assert "y\\|z" in md and "a `code` \\<b\\> and **bold**" in md
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


# ------------------------------------------------------------------ per-class and clients


def _lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _per_class_last(folder: Path, last: int = 10) -> np.ndarray:
    """Each class's mean over the last evaluated rounds, NaN for a class never scored."""
    table = np.array(
        [[np.nan if v is None else v for v in r["per_class_accuracy"]] for r in _lines(folder)
         if "per_class_accuracy" in r][-last:], dtype=float,
    )  # fmt: skip
    with np.errstate(all="ignore"):
        return np.nanmean(table, axis=0)


def _counts(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """Per class: training samples of the run's partition and clients holding any, counted
    from partition.npz against the digits labels."""
    from fedskew.data.partition import load_partition
    from fedskew.data.sources import load_dataset

    config = json.loads((folder / "config.json").read_text())
    labels = load_dataset("digits", None, seed=config["seed"]).y_train.numpy()
    per_client = np.array([np.bincount(labels[i], minlength=10)
                           for i in load_partition(folder / "partition.npz")[0]])  # fmt: skip
    return per_client.sum(0), (per_client > 0).sum(0)


def _split(folder: Path) -> tuple[str, float, float]:
    """(rule, minority-half mean %, majority-half mean %) as the report defines them."""
    samples, clients = _counts(folder)
    by_samples = samples.min() == 0 or samples.max() >= 1.1 * samples.min()
    first, second = (samples, clients) if by_samples else (clients, samples)
    order = np.lexsort((np.arange(10), second, first))  # last key sorts first
    acc = 100 * _per_class_last(folder)
    return (
        "share of the training data" if by_samples else "number of clients holding",
        float(np.nanmean(acc[order[:5]])),
        float(np.nanmean(acc[order[5:]])),
    )


def _cell(values: list[float], sign: str = "") -> str:
    a = np.array(values)
    return f"{a.mean():{sign}.2f} ± {a.std(ddof=1):.2f}"


def _seed_cell(values: list[float]) -> str:
    """As :func:`_cell`, or the value and "(1 seed)" for one value."""
    return _cell(values) if len(values) > 1 else f"{values[0]:.2f} (1 seed)"


def test_summary_has_per_class_accuracy_of_the_final_and_last_rounds(grid):
    for folder in sorted(p for p in grid.iterdir() if p.is_dir()):
        summary = json.loads((folder / "summary.json").read_text())
        rows = _lines(folder)
        assert summary["final_per_class_accuracy"] == rows[-1]["per_class_accuracy"]
        assert summary["per_class_last_k"] == 2  # 2 evaluated rounds, fewer than 10
        mean = np.mean([r["per_class_accuracy"] for r in rows], axis=0)
        assert np.allclose(summary["last_k_per_class_accuracy"], mean, atol=1e-6)
        resolved = json.loads((folder / "config.json").read_text())["resolved"]
        samples, clients = _counts(folder)
        assert resolved["partition_class_samples"] == samples.tolist()
        assert resolved["partition_class_clients"] == clients.tolist()
        assert resolved["class_names"] == [str(i) for i in range(10)]


def _split_rows(md: str) -> dict[str, str]:
    section = md.split("## Per-class accuracy", 1)[1].split("\n## ", 1)[0]
    return {
        line.split(" | ")[0].removeprefix("| "): line
        for line in section.splitlines()
        if line.startswith(("| fedavg |", "| prox |"))
    }


def _expected_split_rows(grid: Path) -> tuple[str, dict[str, list[str]]]:
    rules, rows = set(), {}
    for method in ("fedavg", "prox"):
        splits = [_split(grid / f"{method}-s{seed}") for seed in (0, 1)]
        rules |= {rule for rule, _, _ in splits}
        low, high = [s[1] for s in splits], [s[2] for s in splits]
        gap = [b - a for a, b in zip(low, high, strict=True)]
        worst = [100 * np.nanmin(_per_class_last(grid / f"{method}-s{s}")) for s in (0, 1)]
        rows[method] = [method, "2", _cell(low), _cell(high), _cell(gap, "+"), _cell(worst)]
    [rule] = rules
    return rule, rows


def test_report_per_class_heatmap_and_minority_majority_table(grid, tmp_path):
    out = tmp_path / "r"
    assert main(["report", str(grid), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Per-class accuracy" in md
    assert (out / "report_files" / "per-class-all.png").read_bytes().startswith(b"\x89PNG")
    rule, expected = _expected_split_rows(grid)
    assert md.count(f"ranked by the {rule}") == 2  # one line per seed, naming the rule
    assert md.count("(counts from config.json)") == 2
    rows = _split_rows(md)
    for method, cells in expected.items():
        assert rows[method] == "| " + " | ".join(cells) + " |"
    assert md.count("No per-client test split: run with --local-test-fraction.") == 1


def test_report_per_class_of_runs_from_before_the_summary_recorded_it(grid, tmp_path):
    """Folders without the per-class summary and the recorded class counts: the numbers come
    from metrics.jsonl and the counts from partition.npz, or the partition rebuilt."""
    import shutil

    copy = tmp_path / "grid"
    shutil.copytree(grid, copy)
    for folder in sorted(copy.iterdir()):
        path = folder / "summary.json"
        summary = json.loads(path.read_text())
        for key in ("final_per_class_accuracy", "last_k_per_class_accuracy", "per_class_last_k"):
            del summary[key]
        path.write_text(json.dumps(summary))
        path = folder / "config.json"
        config = json.loads(path.read_text())
        for key in ("partition_class_samples", "partition_class_clients", "class_names"):
            del config["resolved"][key]
        path.write_text(json.dumps(config))
    rule, expected = _expected_split_rows(grid)
    assert main(["report", str(copy), "-o", str(tmp_path / "a")]) == 0
    md = (tmp_path / "a" / "report.md").read_text()
    assert md.count("(counts from partition.npz with the dataset's labels)") == 2
    assert all(r == "| " + " | ".join(expected[m]) + " |" for m, r in _split_rows(md).items())
    for folder in copy.iterdir():
        (folder / "partition.npz").unlink()
    path = copy / "prox-s1" / "metrics.jsonl"
    path.write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "per_class_accuracy"}) + "\n"
        for r in _lines(path.parent)
    ))  # fmt: skip
    assert main(["report", str(copy), "-o", str(tmp_path / "b")]) == 0
    md = (tmp_path / "b" / "report.md").read_text()
    assert (
        md.count("(counts from partition rebuilt from config.json with the dataset's labels)") == 2
    )
    assert "Per-class accuracy not recorded in: prox seed 1." in md
    assert _split_rows(md)["fedavg"] == "| " + " | ".join(expected["fedavg"]) + " |"
    assert _split_rows(md)["prox"].startswith("| prox | 1 |")


def test_report_client_spread_of_runs_with_a_local_test_split(grid, tmp_path):
    """At the final round (--statistic final), the per-client statistics as summary.json,
    the metrics line or only the list give them (the worst and best client from the list
    alone); personalised columns where a run has them."""
    import shutil

    copy = tmp_path / "grid"
    shutil.copytree(grid, copy)
    rng = np.random.default_rng(3)
    lists = {name: rng.uniform(0.2, 1.0, 4).round(4).tolist() for name in
             ("fedavg-s0", "fedavg-s1", "prox-s0", "prox-s1", "prox-s0p", "prox-s1p")}  # fmt: skip
    lists["fedavg-s1"][2] = None  # a client without local test samples

    def stats(values: list) -> dict[str, float]:
        a = np.sort([v for v in values if v is not None])
        t = int(np.ceil(0.1 * a.size))
        return {"mean": a.mean(), "std": a.std(), "worst10": a[:t].mean(),
                "gap": a[-t:].mean() - a[:t].mean()}  # fmt: skip

    def extremes(values: list) -> dict[str, float]:
        a = [v for v in values if v is not None]
        return {"worst": min(a), "best": max(a)}

    for name in ("fedavg-s0", "fedavg-s1", "prox-s0", "prox-s1"):
        rows = _lines(copy / name)
        last = rows[-1]
        last["client_accuracy"] = lists[name]
        if name.startswith("prox"):  # the statistics in the line, personal ones too
            for prefix, values in (("client_accuracy", lists[name]),
                                   ("client_personal_accuracy", lists[name + "p"])):  # fmt: skip
                last.update({f"{prefix}_{k}": v for k, v in stats(values).items()})
            last["client_personal_accuracy"] = lists[name + "p"]
        if name == "fedavg-s0":  # the final values in summary.json only
            path = copy / name / "summary.json"
            summary = json.loads(path.read_text())
            summary.update({f"final_client_accuracy_{k}": v
                            for k, v in stats(lists[name]).items()})  # fmt: skip
            path.write_text(json.dumps(summary))
            del last["client_accuracy"]
        (copy / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(copy), "-o", str(tmp_path / "r"), "--statistic", "final"]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    section = md.split("## Accuracy across clients", 1)[1].split("\n## ", 1)[0]
    assert "No per-client test split" not in section
    header = next(x for x in section.splitlines() if x.startswith("| method |"))
    assert "personalised client mean (%)" in header
    for method in ("fedavg", "prox"):
        cells = [method, "2"]
        for suffix in ("", "p"):
            if method == "fedavg" and suffix:  # fedavg has no personal model
                cells += ["-"] * 6
                continue
            got = [stats(lists[f"{method}-s{s}{suffix}"]) for s in (0, 1)]
            # fedavg-s0 recorded its statistics in summary.json only: no list, no extremes
            listed = (1,) if method == "fedavg" else (0, 1)
            ends = [extremes(lists[f"{method}-s{s}{suffix}"]) for s in listed]
            cells += [_cell([100 * g[k] for g in got]) for k in ("mean", "std", "worst10")]
            cells += [_seed_cell([100 * e[k] for e in ends]) for k in ("worst", "best")]
            cells.append(_cell([100 * g["gap"] for g in got]))
        assert "| " + " | ".join(cells) + " |" in section.splitlines(), (method, section)
