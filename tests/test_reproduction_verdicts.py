"""The verdict rule of reproduction/make_report.py: REPRODUCTION.md's conclusions are
computed by it, so its cases (ahead on every seed, on some, diverged runs, a risk where
lower is better, "alike" claims) are pinned here on made-up run records."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedskew.report.runs import RunRecord


@pytest.fixture(scope="module")
def mr(reproduction_script):
    return reproduction_script("make_report.py")


def record(method: str, seed: int, accs: list[float] | None, key: str = "accuracy") -> RunRecord:
    """A finished run whose last rounds have ``accs`` (None: an unfinished one)."""
    rows = [{"round": i + 1, key: a} for i, a in enumerate(accs or [0.1])]
    return RunRecord(
        folder=Path(f"/nonexistent/{method}-s{seed}"),
        setting="",
        method=method,
        seed=seed,
        config={"rounds": len(rows)},
        resolved={},
        metrics=rows,
        summary={} if accs is not None else None,
        processes=[],
    )


def grid(mr, tmp_path, monkeypatch, records, diverged=()):
    """A grid named "g" over seeds 0-2; ``diverged`` lists (method, seed) whose compare log
    says the run diverged."""
    monkeypatch.setattr(mr, "RUNS", tmp_path)
    logs = tmp_path / "g" / "logs"
    logs.mkdir(parents=True)
    for method, seed in diverged:
        (logs / f"{method}-s{seed}.log").write_text(
            "fedskew: error: round 4: client 7 diverged (NaN or Inf in its reply)"
        )
    return mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, records)


def claim(mr, method="a", against=("b",), **kw):
    return mr.Claim("P", "a above b", "-", "g", "", method, list(against), **kw)


def test_ahead_on_every_seed_is_reproduced(mr, tmp_path, monkeypatch):
    recs = [record("a", s, [0.5 + s / 100]) for s in range(3)]
    recs += [record("b", s, [0.4]) for s in range(3)]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict.startswith("reproduced (ahead on 3 of 3 seeds)")
    assert out.seeds == "3 of 3"
    assert out.difference.startswith("+11.00")


def test_ahead_on_average_but_not_on_every_seed_is_partly(mr, tmp_path, monkeypatch):
    recs = [record("a", 0, [0.9]), record("a", 1, [0.3]), record("a", 2, [0.5])]
    recs += [record("b", s, [0.4]) for s in range(3)]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict.startswith("partly (ahead on 2 of 3 seeds)")


def test_behind_everywhere_is_not_reproduced_and_missing_seeds_are_pending(
    mr, tmp_path, monkeypatch
):
    recs = [record("a", 0, [0.3]), record("b", 0, [0.4]), record("b", 1, [0.4])]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict == "not reproduced (ahead on 0 of 1 seeds); 2 seed(s) pending"


def test_a_diverged_run_decides_its_seed(mr, tmp_path, monkeypatch):
    # Seed 0: both finished, a ahead. Seed 1: b diverged, a finished -> won.
    # Seed 2: a diverged -> lost, whatever b did.
    recs = [record("a", 0, [0.5]), record("b", 0, [0.4]), record("a", 1, [0.5])]
    recs += [record("b", 2, [0.4])]
    g = grid(mr, tmp_path, monkeypatch, recs, diverged=[("b", 1), ("a", 2)])
    out = mr.judge(claim(mr), g)
    assert out.seeds == "1 of 3 (+2 decided by a divergence)"
    assert out.verdict.startswith("partly (ahead on 2 of 3 seeds)")
    assert "b seed 1: diverged (NaN) in round 4" in out.verdict


def test_an_unrun_claimed_method_does_not_win_by_the_others_divergence(mr, tmp_path, monkeypatch):
    g = grid(mr, tmp_path, monkeypatch, [], diverged=[("b", 0)])
    out = mr.judge(claim(mr), g)
    assert out.verdict.startswith("pending")


def test_best_of_several_needs_the_claimed_method_above_each(mr, tmp_path, monkeypatch):
    recs = []
    for s in range(3):
        recs += [record("a", s, [0.5]), record("b", s, [0.4]), record("c", s, [0.45 + s / 20])]
    out = mr.judge(
        claim(mr, against=("b", "c"), kind="best"), grid(mr, tmp_path, monkeypatch, recs)
    )
    # c beats a on seeds 1 (0.50 = 0.50, not above) and 2 (0.55).
    assert out.verdict.startswith("partly (ahead on 1 of 3 seeds)")


def test_best_of_several_loses_a_seed_before_every_run_finished(mr, tmp_path, monkeypatch):
    # Seed 0: c finished ahead of a, b not run -> lost already (b can only add a rival).
    # Seed 1: a ahead of c, b not run -> undecided. Seed 2: a not run -> undecided.
    recs = [record("a", 0, [0.30]), record("c", 0, [0.40])]
    recs += [record("a", 1, [0.50]), record("c", 1, [0.40]), record("c", 2, [0.40])]
    g = grid(mr, tmp_path, monkeypatch, recs)
    out = mr.judge(claim(mr, against=("b", "c"), kind="best"), g)
    assert out.seeds == "0 of 3 (+1 lost before all their runs finished)"
    assert out.verdict == (
        "not reproduced (ahead on 0 of 1 seeds); 2 seed(s) pending; "
        "seed 0 lost: c 40.00 vs a 30.00, decided before every run finished"
    )
    assert out.difference == "-"  # no seed has every run: nothing to average
    # An "above" claim has one rival: nothing is decided before both runs finish.
    assert mr.judge(claim(mr, against=("b",)), g).verdict.startswith("pending")


def test_lower_is_better_reads_a_lower_value_as_ahead(mr, tmp_path, monkeypatch):
    recs = [record("a", s, [0.70], key="local_risk") for s in range(3)]
    recs += [record("b", s, [0.80], key="local_risk") for s in range(3)]
    c = claim(mr, metric="local_risk", lower_is_better=True)
    out = mr.judge(c, grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict.startswith("reproduced (ahead on 3 of 3 seeds)")
    assert out.ours == "a: 70.00 ± 0.00"  # shown as measured, not negated
    assert out.difference.startswith("-10.00")


def test_alike_within_the_limit(mr, tmp_path, monkeypatch):
    recs = [record("a", s, [0.500]) for s in range(3)]
    recs += [record("b", s, [0.495]) for s in range(3)]
    out = mr.judge(claim(mr, kind="similar"), grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict.startswith("reproduced (mean difference +0.50")
    recs = [record("a", s, [0.50]) for s in range(3)]
    recs += [record("b", s, [0.45]) for s in range(3)]
    out = mr.judge(claim(mr, kind="similar"), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, recs))
    assert out.verdict.startswith("not reproduced (mean difference +5.00")


def timed(method: str, seed: int, setting: str, seconds: float, finished: bool = True):
    rows = [{"round": 1, "accuracy": 0.5, "seconds": seconds, "eval_seconds": 1.0}]
    return RunRecord(
        folder=Path(f"/nonexistent/{setting}/{method}-s{seed}"), setting=setting,
        method=method, seed=seed, config={"rounds": 2}, resolved={}, metrics=rows,
        summary={} if finished else None, processes=[],
    )  # fmt: skip


def test_still_to_run_lists_unfinished_runs_with_an_estimate_from_finished_ones(
    mr, tmp_path, monkeypatch
):
    monkeypatch.setattr(mr, "RUNS", tmp_path)
    logs = tmp_path / "g" / "logs"
    logs.mkdir(parents=True)
    (logs / "x__b-s1.log").write_text("fedskew: error: round 2: client 3 diverged (NaN)")
    runs = [
        {"setting": st, "method": m, "seed": s, "folder": f"{st}/{m}-s{s}"}
        for st in ("x", "y") for m in ("a", "b") for s in (0, 1)
    ]  # fmt: skip
    records = [
        timed("a", 0, "x", 99.0),
        timed("b", 0, "x", 199.0),
        timed("a", 1, "x", 5.0, finished=False),  # unfinished: 1 of 2 rounds
    ]
    g = mr.Grid("g", {"seeds": [0, 1], "runs": runs}, records)
    pending = mr.pending_runs(g)
    # x/b-s1 diverged: done for the verdicts; y has no finished run: no estimate.
    assert pending == [
        ("x", "a", 1, "s1 unfinished, 1 of 2 rounds", 100.0),
        ("y", "a", 0, "s0", None),
        ("y", "a", 1, "s1", None),
        ("y", "b", 0, "s0", None),
        ("y", "b", 1, "s1", None),
    ]
    [row] = mr.pending_rows("g", pending[:1] + [("x", "c", 0, "s0", None)], "a verdict")
    listed = "x/a (s1 unfinished, 1 of 2 rounds); x/c (s0)"
    assert row[2:] == ["2", "about 0.0 (for 1 of them)", listed]


def test_still_to_run_tells_runs_a_verdict_waits_for_from_those_that_only_fill_means(
    mr, tmp_path, monkeypatch
):
    # "a best of b, c": seed 0 is lost already (c ahead), so b-s0 only fills the means;
    # seed 1 is open (a ahead of c, b missing), so b-s1 decides. d is in no claim.
    g = grid(
        mr,
        tmp_path,
        monkeypatch,
        [record("a", 0, [0.3]), record("c", 0, [0.4]), record("a", 1, [0.5])]
        + [record("c", 1, [0.4])],
    )
    g.manifest = {
        "seeds": [0, 1],
        "last": 1,
        "runs": [
            {"setting": "", "method": m, "seed": s, "folder": f"{m}-s{s}"}
            for m in "abcd"
            for s in (0, 1)
        ],
    }
    best = claim(mr, against=("b", "c"), kind="best")
    monkeypatch.setattr(mr, "CLAIMS", [best])
    section = mr.pending_section({"g": g}, [(best, mr.judge(best, g))])
    rows = {line.split("|")[2].strip(): line for line in section[2:]}
    assert "b (s1)" in rows["a verdict"]
    assert "b (s0)" in rows["a claim's means only"]
    assert "d (s0, s1)" in rows["no claim"]


def test_per_class_view_splits_classes_as_the_report_does(mr, tmp_path, monkeypatch):
    """Per setting, the minority and majority halves from the counts config.json recorded:
    4 classes, totals alike, so ranked by clients (classes 1 and 3 held by one client)."""
    counts = {"partition_class_samples": [100, 100, 100, 100],
              "partition_class_clients": [3, 1, 4, 1], "class_names": list("abcd")}  # fmt: skip
    recs = []
    for method, accs in (("a", [0.9, 0.1, 0.8, 0.3]), ("b", [0.7, 0.5, 0.6, 0.5])):
        for seed in range(3):
            rec = record(method, seed, [0.5])
            rec.resolved = counts
            rec.metrics[0]["per_class_accuracy"] = [x + seed / 100 for x in accs]
            recs.append(rec)
    lines = mr.per_class_section({"g": grid(mr, tmp_path, monkeypatch, recs)})
    assert lines[0] == "### g"
    assert any("seed 0: ranked by the number of clients holding the class" in x
               and "minority half: b, d; majority half: a, c" in x for x in lines)  # fmt: skip
    # a: minority (0.1 + 0.3) / 2 = 20 % (+1 per seed), majority 85 %; std over seeds 1.00
    assert "| - | a | 3 | 21.00 ± 1.00 | 86.00 ± 1.00 | +65.00 ± 0.00 | 11.00 ± 1.00 |" in lines
    assert "| - | b | 3 | 51.00 ± 1.00 | 66.00 ± 1.00 | +15.00 ± 0.00 | 51.00 ± 1.00 |" in lines
