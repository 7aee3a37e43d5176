"""The verdict rule of reproduction/make_report.py: REPRODUCTION.md's conclusions are
computed by it, so its cases (ahead on every seed, on some, diverged runs, a risk where
lower is better, "alike" claims, a lead within the noise, runs from several machines) are
pinned here on made-up run records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedskew.report.runs import RunRecord

INTEL = "Intel(R) Xeon(R) Processor"
AMD = "AMD EPYC"


@pytest.fixture(scope="module")
def mr(reproduction_script):
    return reproduction_script("make_report.py")


def process(cpu: str = AMD, commit: str = "c0ffee", dirty: bool = False, **more) -> dict:
    """A processes.jsonl line: the machine and commit that computed the run's rounds."""
    return {"from_round": 1, "cpu": cpu, "git_commit": commit, "git_dirty": dirty,
            "torch": "2.13.0+cpu", "torch_threads": 1, **more}  # fmt: skip


def record(
    method: str, seed: int, accs: list[float] | None, key: str = "accuracy", procs=None
) -> RunRecord:
    """A finished run whose last rounds have ``accs`` (None: an unfinished one), computed by
    ``procs`` (default: one process on one machine at one clean commit)."""
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
        processes=[process()] if procs is None else procs,
    )


def grid(mr, tmp_path, monkeypatch, records, diverged=(), seeds=(0, 1, 2)):
    """A grid named "g" over ``seeds``; ``diverged`` lists (method, seed) whose compare log
    says the run diverged."""
    monkeypatch.setattr(mr, "RUNS", tmp_path)
    logs = tmp_path / "g" / "logs"
    logs.mkdir(parents=True)
    for method, seed in diverged:
        (logs / f"{method}-s{seed}.log").write_text(
            "fedskew: error: round 4: client 7 diverged (NaN or Inf in its reply)"
        )
    return mr.Grid("g", {"seeds": list(seeds), "last": 1}, records)


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
    # Six seeds, one behind: +10 on five, -1 on one; mean +8.17, t-interval +-4.71, so the
    # lead is outside the noise and the seed behind makes it partly.
    recs = [record("a", s, [0.5]) for s in range(6)]
    recs += [record("b", s, [0.4]) for s in range(5)] + [record("b", 5, [0.51])]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, recs, seeds=range(6)))
    assert out.verdict.startswith("partly (ahead on 5 of 6 seeds)")


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
    for s in range(6):
        # c: 0.40 on seeds 0-3, 0.50 on seed 4 (equal to a: not above), 0.41 on seed 5
        c = {4: 0.50, 5: 0.41}.get(s, 0.40)
        recs += [record("a", s, [0.5]), record("b", s, [0.45]), record("c", s, [c])]
    out = mr.judge(
        claim(mr, against=("b", "c"), kind="best"),
        grid(mr, tmp_path, monkeypatch, recs, seeds=range(6)),
    )
    # Against the best rival per seed: +5 (b) on seeds 0-3 and 5, 0 on seed 4.
    assert out.verdict.startswith("partly (ahead on 5 of 6 seeds)")


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


# --------------------------------------------------------------------------- noise


def spread(mr, **kinds: float):
    """A measured rerun spread: {kind: gap at a window of 1 round} for accuracy."""
    names = {"same": mr.SAME, "commit": "another commit, same CPU model", "machine": mr.MACHINE}
    return mr.RerunSpread(
        {names[k]: {"runs": ["x"], "accuracy": {"window": {"1": v}}} for k, v in kinds.items()}
    )


def close_leads(procs_a, procs_b):
    """a 0.3 points ahead of b on every seed (+0.25, +0.30, +0.35): a t-interval of
    +-0.12, so only the rerun spread can make the lead noise."""
    recs = [record("a", s, [0.5 + (s - 1) / 2000], procs=procs_a) for s in range(3)]
    recs += [record("b", s, [0.497], procs=procs_b) for s in range(3)]
    return recs


def test_a_lead_inside_the_rerun_spread_is_within_noise_not_reproduced(mr, tmp_path, monkeypatch):
    """Runs from two machines admit the spread measured across machines: a +0.30 lead on
    every seed inside a 0.8-point spread is noise, not a reproduction; the same runs from
    one machine and one clean commit, where reruns agree bit for bit, reproduce it."""
    measured = spread(mr, same=0.0, commit=0.3, machine=0.8)
    mixed = grid(mr, tmp_path, monkeypatch, close_leads([process(INTEL)], [process(AMD)]))
    out = mr.judge(claim(mr), mixed, measured)
    assert out.verdict == "within noise (lead +0.30 within ±0.80; ahead on 3 of 3 seeds)"
    assert out.margin.startswith("±0.80 (rerun 0.80 [another machine]; t 0.12)")
    one = mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, close_leads([process()], [process()]))
    assert mr.judge(claim(mr), one, measured).verdict.startswith(
        "reproduced (ahead on 3 of 3 seeds)"
    )
    # One CPU model, two commits: the spread across commits (0.3) covers the +0.30 lead.
    commits = close_leads([process(commit="c0ffee")], [process(commit="decade")])
    out = mr.judge(claim(mr), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, commits), measured)
    assert out.verdict.startswith("within noise (lead +0.30 within ±0.30")


def test_a_lead_inside_the_seeds_t_interval_is_within_noise(mr, tmp_path, monkeypatch):
    """Ahead on every seed by +0.1, +0.2 and +0.6 points (as FedACD over FedACD_base was
    'reproduced' on +0.31 +- 0.17): the 95 % t-interval of the mean is +-0.66, so without
    any rerun spread the lead is still within noise, and a risk reads alike."""
    recs = [record("a", s, [0.5 + d]) for s, d in enumerate((0.001, 0.002, 0.006))]
    recs += [record("b", s, [0.5]) for s in range(3)]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, recs))
    assert out.verdict == "within noise (lead +0.30 within ±0.66; ahead on 3 of 3 seeds)"
    assert "rerun spread not measured for accuracy; t 0.66" in out.margin
    behind = [record("a", s, [0.5]) for s in range(3)]
    behind += [record("b", s, [0.5 + d]) for s, d in enumerate((0.001, 0.002, 0.006))]
    out = mr.judge(claim(mr), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, behind))
    assert out.verdict.startswith("within noise (lead -0.30")  # not "not reproduced"


def test_noise_never_hides_a_divergence_or_an_early_loss(mr, tmp_path, monkeypatch):
    # Seed 0: a +0.1 ahead (inside any margin); seeds 1, 2: b diverged. The seeds decided
    # by the divergences have no paired number: the outcomes decide, not the margin.
    recs = [record("a", s, [0.501]) for s in range(3)] + [record("b", 0, [0.5])]
    g = grid(mr, tmp_path, monkeypatch, recs, diverged=[("b", 1), ("b", 2)])
    out = mr.judge(claim(mr), g, spread(mr, machine=5.0))
    assert out.verdict.startswith("reproduced (ahead on 3 of 3 seeds)")


def test_an_unmeasured_kind_is_stood_in_for_and_said(mr):
    measured = spread(mr, same=0.0, machine=0.8)
    assert measured.at(mr.SAME, "accuracy", 1) == (0.0, mr.SAME, True)
    # Reruns at another commit as bitwise alike as two here: the claim's own kind is named.
    alike = spread(mr, same=0.0, commit=0.0, machine=0.8)
    commit = "another commit, same CPU model"
    assert alike.at(commit, "accuracy", 1) == (0.0, commit, True)
    # Only "same machine" and "another machine" measured: a claim from two commits takes
    # the broadest spread measured, and its row says that kind stood in.
    assert measured.at(commit, "accuracy", 1) == (0.8, mr.MACHINE, False)
    noise = mr.noise_of([0.5, 0.6], commit, "accuracy", 1, measured)
    assert "standing in for another commit, same CPU model, not measured" in noise.text("accuracy")
    assert measured.at(mr.MACHINE, "local_risk", 1) is None  # only what was measured


def test_runs_from_one_machine_and_clean_commit_or_which(mr, tmp_path, monkeypatch):
    one = [record(m, s, [0.5], procs=[process()]) for m in "ab" for s in range(3)]
    out = mr.judge(claim(mr), grid(mr, tmp_path, monkeypatch, one))
    assert out.origin == f"one machine and one clean commit ({AMD}; c0ffee)"
    # b seed 2 ran from a modified tree on the Intel machine; a seed 1 was resumed there.
    mixed = [record("a", s, [0.5], procs=[process()]) for s in (0, 2)]
    mixed += [record("a", 1, [0.5], procs=[process(), process(INTEL, from_round=2)])]
    mixed += [record("b", s, [0.4], procs=[process()]) for s in (0, 1)]
    mixed += [record("b", 2, [0.4], procs=[process(INTEL, "decade", dirty=True)])]
    out = mr.judge(claim(mr), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, mixed))
    assert out.origin == (
        f"not one machine and one clean commit: 2 machines: [{AMD}] a s0/1/2, b s0/1; "
        f"[{INTEL}] a s1, b s2; 2 commits (a modified tree counted apart): [c0ffee] a s0/1/2, "
        "b s0/1; [decade (modified)] b s2"
    )
    # One machine, one commit but a modified tree: not clean, so not "one clean commit".
    dirty = [record(m, s, [0.5], procs=[process(dirty=True)]) for m in "ab" for s in range(3)]
    out = mr.judge(claim(mr), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, dirty))
    assert out.origin == (
        f"not one machine and one clean commit: 1 machine ({AMD}); "
        "1 commit: [c0ffee (modified)] a s0/1/2, b s0/1/2"
    )
    # A folder without processes.jsonl says nothing of where it ran: not one machine.
    unknown = [record(m, s, [0.5], procs=[]) for m in "ab" for s in range(3)]
    out = mr.judge(claim(mr), mr.Grid("g", {"seeds": [0, 1, 2], "last": 1}, unknown))
    assert out.origin.startswith("not one machine and one clean commit")
    assert out.origin.endswith("1 machine (not recorded); 1 commit (not recorded)")


def test_the_claims_table_has_the_margin_and_where_the_runs_came_from(mr, tmp_path, monkeypatch):
    recs = close_leads([process(INTEL)], [process(AMD)])
    g = grid(mr, tmp_path, monkeypatch, recs)
    monkeypatch.setattr(mr, "CLAIMS", [claim(mr)])
    monkeypatch.setattr(mr, "GRIDS", {})
    monkeypatch.setattr(mr, "SPREAD_FILE", tmp_path / "rerun_spread.json")
    (tmp_path / "rerun_spread.json").write_text(json.dumps({
        "runs": {"x": {"seed": 0, "reruns": [], "pairs": []}},
        "spread": {mr.MACHINE: {"runs": ["x"], "accuracy": {"window": {"1": 0.8}}}},
    }))  # fmt: skip
    text = mr.build({"g": g})
    row = next(line for line in text.splitlines() if line.startswith("| P | a above b"))
    assert "**within noise (lead +0.30 within ±0.80; ahead on 3 of 3 seeds)**" in row
    assert f"2 machines: [{INTEL}] a s0/1/2; [{AMD}] b s0/1/2" in row
    assert "| P | 0 | 0 | 1 | 0 | 0 |" in text  # the summary counts it as within noise


def test_the_committed_rerun_spread_is_what_the_rule_reads(mr):
    """REPRODUCTION.md's margins come from reproduction/rerun_spread.json, measured by
    rerun_spread.py: each kind it names has accuracy gaps at the window the grids use."""
    measured = mr.read_spread()
    assert measured is not None and measured.kinds
    for kind, found in measured.kinds.items():
        assert kind in mr.KINDS and found["runs"]
        assert measured.measured(kind, "accuracy", 3) is not None


# --------------------------------------------------------------------------- written from runs


def fm_run(method: str, seed: int, lr: float, params: dict, rounds: int = 12) -> RunRecord:
    rec = record(method, seed, [0.5] * rounds)
    rec.config = {"rounds": rounds, "local_epochs": 1, "lr": lr, "params": dict(params)}
    # What fedskew resolves: the algorithm's defaults with the run's values over them (FedFM
    # has a launching round, FedAvg and SCAFFOLD none).
    fm = {"lam": 50.0, "start_round": 0} if "start_round" in params else {"server_lr": 1.0}
    rec.resolved = {"algorithm_params": {**fm, **params}}
    return rec


def tuned_claim(mr):
    return next(c for c in mr.CLAIMS if c.grid == "fedfm-tuned/evaluation")


def test_the_tuned_row_says_what_the_tuned_runs_used(mr, tmp_path, monkeypatch):
    """The tuned FedFM launched at T_s 8 with lam 0.169: its row says so, from the run
    folders' configurations, not the untuned grid's 'T_s 3'."""
    monkeypatch.setattr(mr, "RUNS", tmp_path)
    study = tmp_path / "fedfm-tuned"
    study.mkdir()
    (study / "tune.json").write_text(json.dumps({
        "trials_per_method": 16, "tuning_seeds": [100], "last": 3,
        "objective": "mean accuracy (%) of the last 3 rounds on the validation split",
        "validation_fraction": 0.2,
        "search_space": {
            "fedavg": {"lr": {"log": [0.001, 0.1]}},
            "fedfm": {"lr": {"log": [0.001, 0.1]}, "params.lam": {"log": [0.1, 100]},
                      "params.start_round": {"int": [0, 8]}},
        },
    }))  # fmt: skip
    recs = [fm_run("fedfm", s, 0.0133853, {"start_round": 8, "lam": 0.16899}) for s in range(3)]
    recs += [fm_run("fedavg", s, 0.011781, {}) for s in range(3)]
    g = mr.Grid("fedfm-tuned/evaluation", {"seeds": [0, 1, 2], "last": 3}, recs)
    text = mr.differences(tuned_claim(mr), g)
    assert text.startswith("12 rounds of 1 local epoch instead of 100 of 10 (T_s 8 instead of 20)")
    assert "T_s 3" not in text
    assert "fedfm lr 0.01339, lam 0.169, T_s 8; fedavg lr 0.01178" in text
    assert "16 trials per method; tuning seeds [100]; validation fraction 0.2" in text
    assert "objective: mean accuracy (%) of the last 3 rounds on the validation split" in text
    # The Tuning section names the held-out split too, beside the study's other terms.
    study_record = json.loads((study / "tune.json").read_text())
    study_record.update(evaluation_seeds=[0, 1, 2], sampler="tpe", sampler_seed=0,
                        pruner="none", results={})  # fmt: skip
    (study / "tune.json").write_text(json.dumps(study_record))
    assert "; validation fraction 0.2; sampler tpe" in mr.tuning_section()[0]
    # Before the evaluation runs finish: tuned.json's values, said to be so.
    (study / "tuned.json").write_text(json.dumps({"methods": {
        "fedfm": {"algorithm": "fedfm", "lr": 0.02, "params": {"start_round": 5, "lam": 1.0}},
        "fedavg": {"algorithm": "fedavg", "lr": 0.03},
    }}))  # fmt: skip
    empty = mr.Grid("fedfm-tuned/evaluation", {"seeds": [0, 1, 2], "last": 3}, [])
    text = mr.differences(tuned_claim(mr), empty)
    assert "tuned.json's values (no evaluation run finished): fedfm lr 0.02, lam 1, T_s 5" in text


def test_fedfm_rows_take_rounds_and_launch_from_their_runs(mr):
    longer = next(c for c in mr.CLAIMS if c.grid == "fedfm-longer" and c.method == "fedfm")
    recs = [fm_run("fedfm", 0, 0.01, {"start_round": 10}, rounds=30)]
    recs += [fm_run("fedavg", 0, 0.01, {}, rounds=30)]
    g = mr.Grid("fedfm-longer", {"seeds": [0], "last": 3}, recs)
    assert mr.differences(longer, g).startswith(
        "30 rounds of 1 local epoch instead of 100 of 10 (T_s 10 instead of 20)"
    )
    # A claim without a FedFM method has no launching round to state.
    scaffold = next(c for c in mr.CLAIMS if c.method == "scaffold" and c.against == ["fedavg"])
    plain = [fm_run(m, 0, 0.01, {}) for m in ("scaffold", "fedavg")]
    for r in plain:
        r.setting = scaffold.setting
    g = mr.Grid("fedfm-cifar10", {"seeds": [0], "last": 3}, plain)
    text = mr.differences(scaffold, g)
    assert text.startswith("12 rounds of 1 local epoch instead of 100 of 10;")
