"""The report's per-class and per-client tables: the statistic each run's value is taken at,
the per-class table (Markdown, CSV, LaTeX), the split of each client's classes into
local-majority, local-minority and absent ones, and the client spread with its plot; the
numbers checked against computations done here from the run folders' files."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fake_runs import record

from fedskew.apps.cli import main
from fedskew.assembly.prepare import load_experiment_data
from fedskew.config import ExperimentConfig
from fedskew.data.local_test import split_local_test
from fedskew.data.partition import load_partition
from fedskew.report.document import Attachment, Bold, Image, to_html, to_markdown
from fedskew.report.latex_style import TableStyle
from fedskew.report.per_class import run_per_class_at
from fedskew.report.per_class_table import (
    MethodClasses,
    per_class_csv,
    per_class_latex,
    per_class_table,
)
from fedskew.report.statistic import Statistic, list_at
from fedskew.runs.loop import run

# ------------------------------------------------------------------------ the statistic


def _rows() -> list[dict]:
    """5 rounds; round 3 is the best; round 4 has no per-class list (as a damaged or older
    line might), round 5 a class without an accuracy."""
    accuracy = [0.3, 0.5, 0.8, 0.6, 0.7]
    per_class = [[0.1, 0.5], [0.3, 0.7], [0.9, 0.7], None, [0.6, None]]
    rows = []
    for i, (a, pc) in enumerate(zip(accuracy, per_class, strict=True)):
        row: dict = {"round": i + 1, "accuracy": a}
        if pc is not None:
            row["per_class_accuracy"] = pc
        rows.append(row)
    return rows


def test_statistic_picks_the_final_the_best_or_the_last_lines():
    rows = _rows()
    key = "per_class_accuracy"
    assert list_at(rows, Statistic("final"), key) == ([0.6, None], 1)
    assert list_at(rows, Statistic("best"), key) == ([0.9, 0.7], 1)  # round 3's model
    # The last 3 lines holding the list: rounds 2, 3 and 5; class 1 over the two that scored it.
    values, k = list_at(rows, Statistic("last", 3), key)
    assert k == 3
    assert values == pytest.approx([(0.3 + 0.9 + 0.6) / 3, (0.7 + 0.7) / 2])
    assert list_at(rows, Statistic("last", 100), key)[1] == 4  # all of them
    # The best round without the list: no value rather than another round's.
    rows[2].pop(key)
    assert list_at(rows, Statistic("best"), key) is None
    assert Statistic("last", 4).phrase([("a", 4), ("b", 2)]) == (
        "the mean of the last 4 evaluated rounds (2 for b)"
    )


def test_statistic_refuses_what_it_is_not():
    from fedskew.core.errors import UsageError

    with pytest.raises(UsageError, match="statistic must be one of final, best, last"):
        Statistic("median")
    with pytest.raises(UsageError, match="last must be a positive integer"):
        Statistic("last", 0)


# ------------------------------------------------------------------- per-class table


def _methods() -> list[MethodClasses]:
    return [
        MethodClasses("fedavg", {0: [0.5, 0.2, None], 1: [0.7, 0.4, None]}, {0: 3, 1: 3}),
        MethodClasses("fed_x", {0: [0.6, 0.3, None], 1: [0.6, 0.3, None]}, {0: 3, 1: 3}),
    ]


def test_per_class_table_in_markdown_with_the_best_of_each_class_bold():
    table = per_class_table(_methods(), ["cat", "dog", "emu"])
    assert table.header == ["method", "seeds", "cat", "dog", "emu"]
    fedavg, fed_x = table.rows
    # cat: 60.00 each, a tie as printed: both bold. dog: 30.00 each, both bold too.
    assert fedavg[2] == Bold(f"60.00 ± {np.std([50, 70], ddof=1):.2f}")
    assert fed_x[2] == Bold("60.00 ± 0.00")
    assert fedavg[3] == Bold(f"30.00 ± {np.std([20, 40], ddof=1):.2f}")
    assert fedavg[4] == fed_x[4] == ""  # no test sample of emu: no value, nothing bold


def test_per_class_table_turns_beyond_twelve_classes():
    runs = {0: [i / 20 for i in range(13)]}
    table = per_class_table([MethodClasses("a", runs, {0: 1})], None)
    assert table.header == ["class", "a (1 seeds)"]
    assert [r[0] for r in table.rows] == [str(c) for c in range(13)]
    assert table.rows[12][1] == Bold("60.00")  # one seed: no ±
    tex = per_class_latex([MethodClasses("a", runs, {0: 1})], None, "", TableStyle(digits=1))
    assert "\\begin{tabular}{lc}" in tex
    assert "12 & $\\mathbf{60.0}$ \\\\" in tex


def test_per_class_csv_and_latex():
    text = per_class_csv({"b0.1": (_methods(), ["cat", "dog", "emu"])}, Statistic("last", 3))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 6  # 2 methods x 3 classes
    first = rows[0]
    assert (first["setting"], first["method"], first["class_name"]) == ("b0.1", "fedavg", "cat")
    assert (first["seeds"], first["rounds"], first["n_seeds"]) == ("0;1", "3;3", "2")
    assert float(first["mean"]) == pytest.approx(60.0)
    assert float(first["std"]) == pytest.approx(np.std([50, 70], ddof=1), abs=1e-4)
    assert first["values"] == "50.0000;70.0000"
    assert rows[2]["mean"] == rows[2]["values"] == "" and rows[2]["n_seeds"] == "0"
    style = TableStyle(names={"fed_x": "Fed_X"}, statistic=Statistic("last", 3), digits=1)
    tex = per_class_latex(_methods(), ["cat", "dog", "emu"], "b0.1", style)
    assert "Method & cat & dog & emu \\\\" in tex
    assert "Fed\\_X & $\\mathbf{60.0 \\pm 0.0}$ & $\\mathbf{30.0 \\pm 0.0}$ & --- \\\\" in tex
    assert "\\label{tab:fedskew-per-class-b0-1}" in tex
    assert "the mean of the last 3 evaluated rounds" in tex
    plain = per_class_latex(_methods(), None, "", TableStyle(bold=False))
    assert "\\mathbf" not in plain and "in bold" not in plain


def test_per_class_at_each_statistic_of_a_run():
    rec = record("fedavg", 0, [30, 50, 80, 60, 70])
    for row, pc in zip(rec.metrics, _rows(), strict=True):
        if "per_class_accuracy" in pc:
            row["per_class_accuracy"] = pc["per_class_accuracy"]
    assert run_per_class_at(rec, Statistic("final")) == [0.6, None]
    assert run_per_class_at(rec, Statistic("best")) == [0.9, 0.7]
    assert run_per_class_at(rec, Statistic("last", 2)) == pytest.approx([0.75, 0.7])


def test_attachments_are_linked_in_markdown_and_named_in_html():
    blocks = [
        Image("per-class.csv", b"\x89PNG", "a picture of the same name"),
        Attachment("per-class <1>.csv", "a,b\n1,\udce9\n", "Table [1]"),
        Attachment("per-class <1>.csv", "3", "Another"),
    ]
    md, files = to_markdown(blocks, "report_files")
    # A lone surrogate (a name that is not UTF-8) is written as U+FFFD.
    assert files == {
        "per-class.csv.png": b"\x89PNG",
        "per-class_1.csv": "a,b\n1,\ufffd\n".encode(),
        "per-class_1-2.csv": b"3",
    }
    assert "Table [1\\]: [per-class_1.csv](report_files/per-class_1.csv)" in md
    assert "Another: [per-class_1-2.csv](report_files/per-class_1-2.csv)" in md
    page = to_html(blocks, "t", "report_files")  # named, not linked: the page stays whole
    assert "<p>Table [1]: <code>report_files/per-class_1.csv</code></p>" in page
    assert "<p>Another: <code>report_files/per-class_1-2.csv</code></p>" in page
    assert "href" not in page


FRACTION = 0.25


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """2 methods x 2 seeds x 3 rounds on digits, 5 clients of a Dirichlet split, each
    holding out a quarter of its data as its local test split."""
    root = tmp_path_factory.mktemp("grid")
    for seed in (0, 1):
        for name, algorithm in (("fedavg", "fedavg"), ("prox", "fedprox")):
            cfg = ExperimentConfig(
                algorithm=algorithm, num_clients=5, clients_per_round=3, rounds=3,
                local_epochs=1, seed=seed, out_dir=str(root), name=f"{name}-s{seed}",
                partition_params={"beta": 0.3}, local_test_fraction=FRACTION, quiet=True,
            )  # fmt: skip
            run(cfg)
    return root


def _lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _cell(values: list[float], sign: str = "") -> str:
    a = np.array(values)
    return f"{a.mean():{sign}.2f} ± {a.std(ddof=1):.2f}"


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _table_row(section: str, method: str) -> list[str]:
    line = next(x for x in section.splitlines() if x.startswith(f"| {method} |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def _by_hand_groups(folder: Path, per_class: list[float]) -> dict[str, float]:
    """The run's accuracy on each group, computed here with plain loops: each client's
    training counts from partition.npz less its local test split, the groups by the
    client's mean count over the classes it holds, the test set's class counts."""
    cfg = ExperimentConfig(seed=json.loads((folder / "config.json").read_text())["seed"])
    data = load_experiment_data(cfg)
    labels = data.y_train.numpy()
    test = np.bincount(data.y_test.numpy(), minlength=10)
    partition = load_partition(folder / "partition.npz")[0]
    train, _ = split_local_test(partition, labels, 10, FRACTION, cfg.seed)
    sums: dict[str, list[float]] = {"majority": [], "minority": [], "absent": []}
    for idx in train:
        counts = [int((labels[idx] == c).sum()) for c in range(10)]
        held = [c for c in range(10) if counts[c] > 0]
        mean = sum(counts) / len(held)
        groups = {
            "majority": [c for c in held if counts[c] >= mean],
            "minority": [c for c in held if counts[c] < mean],
            "absent": [c for c in range(10) if counts[c] == 0],
        }
        for name, classes in groups.items():
            weight = sum(test[c] for c in classes)
            if weight:
                sums[name].append(sum(test[c] * per_class[c] for c in classes) / weight)
    return {name: 100 * float(np.mean(v)) for name, v in sums.items() if v}


def test_local_split_against_a_computation_by_hand(grid, tmp_path):
    assert main(["report", str(grid), "-o", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    section = _section(md, "Local majority, minority and absent classes")
    assert "counts from partition.npz, less each client's local test split" in section
    for method in ("fedavg", "prox"):
        runs = []
        for seed in (0, 1):
            lines = _lines(grid / f"{method}-s{seed}")
            per_class = np.mean([x["per_class_accuracy"] for x in lines], axis=0)  # last 3 of 3
            runs.append(_by_hand_groups(grid / f"{method}-s{seed}", per_class.tolist()))
        row = _table_row(section, method)
        assert row[:2] == [method, "2"]
        for i, group in enumerate(("majority", "minority", "absent")):
            got = [r[group] for r in runs if group in r]
            assert row[2 + i] == _cell(got), (method, group, row)
        assert row[5] == _cell([r["majority"] - r["minority"] for r in runs], "+")
    got = list(
        csv.DictReader(io.StringIO((tmp_path / "r/report_files/local-split.csv").read_text()))
    )
    assert len(got) == 2 * 2 * 3  # runs x groups
    assert {r["rounds"] for r in got} == {"3"} and {r["statistic"] for r in got} == {"last"}
    tex = (tmp_path / "r/report_files/local-split-all.tex").read_text()
    assert "Method & Local-majority & Local-minority & Absent \\\\" in tex


def test_client_spread_at_the_last_rounds_with_plot_csv_and_latex(grid, tmp_path):
    out = tmp_path / "r"
    assert main(["report", str(grid), "-o", str(out), "--last", "2"]) == 0
    md = (out / "report.md").read_text()
    section = _section(md, "Accuracy across clients")
    assert "each run's at the mean of the last 2 evaluated rounds" in section
    for method in ("fedavg", "prox"):
        stats = []
        for seed in (0, 1):
            lists = np.array([x["client_accuracy"] for x in _lines(grid / f"{method}-s{seed}")])
            each = lists[-2:].mean(axis=0)  # each client's own mean over the last 2 rounds
            low = np.sort(each)[:1]  # ceil(0.1 * 5) = 1 client
            stats.append([each.mean(), each.std(), low.mean(), each.min(), each.max(),
                          each.max() - low.mean()])  # fmt: skip
        row = _table_row(section, method)
        expected = [_cell([100 * s[i] for s in stats]) for i in range(6)]
        assert row == [method, "2", *expected]
    png = (out / "report_files" / "clients-all.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    rows = list(csv.DictReader(io.StringIO((out / "report_files" / "clients.csv").read_text())))
    assert [(r["method"], r["seed"], r["rounds"]) for r in rows] == [
        ("fedavg", "0", "2"), ("fedavg", "1", "2"), ("prox", "0", "2"), ("prox", "1", "2")
    ]  # fmt: skip
    lists = np.array([x["client_accuracy"] for x in _lines(grid / "prox-s1")])
    assert [float(v) for v in rows[3]["values"].split(";")] == pytest.approx(
        100 * lists[-2:].mean(axis=0), abs=1e-4
    )
    tex = (out / "report_files" / "clients-all.tex").read_text()
    assert "Method & Mean & Std & Worst 10\\% & Worst & Best & Gap \\\\" in tex


def test_per_class_table_at_the_statistic_asked_for(grid, tmp_path):
    out = tmp_path / "r"
    args = ["report", str(grid), "-o", str(out), "--statistic", "best", "--digits", "1",
            "--display-name", "prox=FedProx"]  # fmt: skip
    assert main(args) == 0
    md = (out / "report.md").read_text()
    section = _section(md, "Per-class accuracy")
    assert "each run's value at the evaluated round of the run's best test accuracy" in section
    best = {}
    for method in ("fedavg", "prox"):
        values = []
        for seed in (0, 1):
            lines = _lines(grid / f"{method}-s{seed}")
            top = max(x["accuracy"] for x in lines)
            line = next(x for x in lines if x["accuracy"] == top)
            values.append([100 * v for v in line["per_class_accuracy"]])
        best[method] = np.array(values)
        row = _table_row(section, method)
        cells = [c.strip("*") for c in row[2:12]]
        assert cells == [_cell(list(best[method][:, c])) for c in range(10)]
    rows = list(csv.DictReader(io.StringIO((out / "report_files/per-class.csv").read_text())))
    assert {r["statistic"] for r in rows} == {"best"}
    assert float(rows[0]["mean"]) == pytest.approx(best["fedavg"][:, 0].mean(), abs=1e-4)
    tex = (out / "report_files" / "per-class-all.tex").read_text()
    prox = next(x for x in tex.splitlines() if x.startswith("FedProx & "))
    first = best["prox"][:, 0]
    assert f"{first.mean():.1f} \\pm {first.std(ddof=1):.1f}" in prox.split(" & ")[1]


def test_a_partition_beyond_the_dataset_is_named_not_a_traceback(grid, tmp_path):
    """partition.npz indexing samples the dataset lacks (another dataset's, or damaged):
    the heatmap and the local split say so, and the report is written."""
    import shutil

    from fedskew.data.partition import save_partition

    folder = tmp_path / "run"
    shutil.copytree(grid / "fedavg-s0", folder)
    partition, meta = load_partition(folder / "partition.npz")
    partition[1] = partition[1] + 100_000
    save_partition(folder / "partition.npz", partition, meta)
    assert main(["report", str(folder), "-o", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    why = "partition.npz: client 1 holds sample indices outside the dataset's 1437 training samples"
    assert f"Partition heatmap not drawn: {why}" in md
    assert f"No split: fedavg seed 0: class counts not available: {why}." in md


def test_minority_majority_split_as_csv_and_latex(grid, tmp_path):
    """The split's numbers, by hand from each run's per-class accuracy and the halves the
    report names for its seed, in the CSV (a line per run) and the LaTeX table."""
    out = tmp_path / "r"
    assert main(["report", str(grid), "-o", str(out), "--display-name", "prox=FedProx"]) == 0
    section = _section((out / "report.md").read_text(), "Per-class accuracy")
    halves = {}
    for seed in (0, 1):
        line = next(x for x in section.splitlines() if x.startswith(f"- seed {seed}: ranked"))
        minority = line.split("minority half: ", 1)[1].split(";", 1)[0]
        majority = line.split("majority half: ", 1)[1].split(" (counts", 1)[0]
        halves[seed] = (
            [int(c) for c in minority.split(", ")],
            [int(c) for c in majority.split(", ")],
        )
    rows = list(csv.DictReader(io.StringIO((out / "report_files/class-halves.csv").read_text())))
    assert [(r["method"], r["seed"]) for r in rows] == [
        ("fedavg", "0"), ("fedavg", "1"), ("prox", "0"), ("prox", "1")
    ]  # fmt: skip
    gaps: dict[str, list[float]] = {}
    for r in rows:
        per_class = np.mean(
            [x["per_class_accuracy"] for x in _lines(grid / f"{r['method']}-s{r['seed']}")], axis=0
        )  # the last 3 of 3 evaluated rounds
        low, high = halves[int(r["seed"])]
        assert float(r["minority"]) == pytest.approx(100 * per_class[low].mean(), abs=1e-4)
        assert float(r["majority"]) == pytest.approx(100 * per_class[high].mean(), abs=1e-4)
        assert float(r["gap"]) == pytest.approx(
            100 * (per_class[high].mean() - per_class[low].mean()), abs=1e-4
        )
        assert float(r["lowest_class"]) == pytest.approx(100 * per_class.min(), abs=1e-4)
        assert r["rounds"] == "3" and r["statistic"] == "last"
        gaps.setdefault(r["method"], []).append(float(r["gap"]))
    tex = (out / "report_files" / "class-halves-all.tex").read_text()
    assert "Method & Minority half & Majority half & Gap & Lowest class \\\\" in tex
    prox = next(x for x in tex.splitlines() if x.startswith("FedProx & "))
    gap = np.array(gaps["prox"])
    assert f"{gap.mean():+.2f} \\pm {gap.std(ddof=1):.2f}" in prox.split(" & ")[3]
