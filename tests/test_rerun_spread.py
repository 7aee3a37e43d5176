"""reproduction/rerun_spread.py: the gaps it measures between a committed run and its reruns,
the kind of difference it files them under, and the partition check that makes a rerun a
rerun (its spread is what REPRODUCTION.md's verdicts take as noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fedskew


@pytest.fixture(scope="module")
def rs(reproduction_script):
    return reproduction_script("rerun_spread.py")


def facts(cpu="AMD EPYC", commit="c0ffee"):
    return {"cpu": [cpu], "commit": [commit], "torch": ["2.13.0+cpu"], "threads": ["1"]}


def test_gaps_per_round_and_per_window_in_points(rs):
    a, b = [0.50, 0.60, 0.70], [0.50, 0.62, 0.66]
    assert rs.round_gaps(a, b) == [0.0, -2.0, 4.0]
    assert rs.window_gaps(a, b) == {"1": 4.0, "2": 1.0, "3": 0.6667}
    assert rs.window_gaps(a, b[:2]) == {"1": -2.0, "2": -1.0}  # the rounds both ran


def test_the_kind_of_difference(rs):
    assert rs.kind_of(facts(), facts()) == rs.SAME
    assert rs.kind_of(facts(commit="decade"), facts()) == rs.COMMIT
    assert rs.kind_of(facts(commit="c0ffee (modified)"), facts()) == rs.COMMIT
    assert rs.kind_of(facts(cpu="Intel(R) Xeon(R) Processor"), facts()) == rs.MACHINE
    resumed = facts()
    resumed["cpu"].append("Intel(R) Xeon(R) Processor")  # its rounds from two machines
    assert rs.kind_of(resumed, facts()) == rs.MACHINE


def pair(kind, gaps):
    windows = {str(k + 1): g for k, g in enumerate(gaps[::-1])}
    return {"kind": kind, "round_gaps": {"accuracy": gaps}, "window_gaps": {"accuracy": windows}}


def test_the_spread_of_a_kind_is_its_largest_gap(rs):
    runs = {
        "x": {"rounds": 3, "pairs": [pair(rs.MACHINE, [1.0, -2.0, -0.5]),
                                     pair(rs.SAME, [0.0, 0.0, 0.0])]},
        "y": {"rounds": 2, "pairs": [pair(rs.MACHINE, [-1.5, 0.25])]},
    }  # fmt: skip
    out = rs.spread(runs)
    assert list(out) == [rs.SAME, rs.MACHINE]  # narrowest first
    machine = out[rs.MACHINE]
    assert machine["runs"] == ["x", "y"]
    assert machine["accuracy"]["round_1"] == 1.5
    assert machine["accuracy"]["any_round"] == 2.0
    # Window 3 only x reached: not a window of the kind (y is 2 rounds long).
    assert machine["accuracy"]["window"] == {"1": 0.5, "2": 2.0}
    assert out[rs.SAME]["accuracy"]["window"] == {"1": 0.0, "2": 0.0, "3": 0.0}


def test_a_rerun_with_another_partition_is_refused_and_one_alike_is_bitwise(
    rs, tmp_path, monkeypatch
):
    """Rerun a tiny committed run twice (digits, 2 rounds): here, at one commit, the two
    reruns agree bit for bit. A committed run whose recorded partition is another is not
    rerun: one line, no spread."""
    runs = tmp_path / "runs"
    fedskew.run(dataset="digits", num_clients=3, rounds=2, local_epochs=1, participation=1.0,
                out_dir=str(runs / "g"), name="a-s0", quiet=True)  # fmt: skip
    (runs / "g" / "a-s0" / "partition.npz").unlink()  # not committed: the digest stands
    monkeypatch.setattr(rs, "RUNS", runs)
    entry = rs.measure("g/a-s0", 2, threads=1)
    assert entry["digest_checked_against"] == "its own"
    between = {p["between"]: p for p in entry["pairs"]}
    assert between["rerun 2 and rerun 1"]["kind"] == rs.SAME
    assert between["rerun 2 and rerun 1"]["bitwise"] is True
    assert between["rerun 2 and rerun 1"]["window_gaps"]["accuracy"] == {"1": 0.0, "2": 0.0}
    assert entry["reruns"][0]["threads"] == ["1"]
    config = runs / "g" / "a-s0" / "config.json"
    saved = json.loads(config.read_text())
    saved["resolved"]["partition_digest"] = "0" * 64
    config.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="not the committed run's .* not a rerun"):
        rs.measure("g/a-s0", 1, threads=1)


def test_a_folder_without_its_digest_is_checked_against_a_sibling(rs, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for name, seed, digest in (("a-s0", 0, None), ("b-s0", 0, "d0"), ("b-s1", 1, "d1")):
        folder = runs / "g" / name
        folder.mkdir(parents=True)
        resolved = {"partition_digest": digest} if digest else {}
        config = {"dataset": "digits", "num_clients": 3, "seed": seed, "resolved": resolved}
        (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(rs, "RUNS", runs)
    record = type("R", (), {"partition_digest": None, "config": {"dataset": "digits",
                                                                 "num_clients": 3, "seed": 0}})
    digest, source = rs.committed_digest(runs / "g" / "a-s0", record)
    assert (digest, source) == ("d0", f"{Path('g/b-s0')}'s (same seed and partition settings)")
    record.config = {**record.config, "seed": 2}
    assert rs.committed_digest(runs / "g" / "a-s0", record) == (None, "not recorded")


def test_unknown_runs_are_refused_in_one_line(rs, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["rerun_spread.py", "--only", "nope/x-s0"])
    with pytest.raises(SystemExit, match="rerun_spread: not in RERUNS: nope/x-s0"):
        rs.main()
