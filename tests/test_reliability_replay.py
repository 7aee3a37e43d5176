"""benchmarks/reliability_replay.py: its case list is well-formed, and its runner classifies
real commands (two of the cheapest cases, run through the script's own runner) and a
traceback or a hang as not clean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def replay(benchmark_script):  # type: ignore[no-untyped-def]
    return benchmark_script("reliability_replay.py")


def test_the_case_list_is_well_formed(replay):
    names = [c.name for c in replay.CASES]
    assert len(names) == len(set(names)) >= 20
    for c in replay.CASES:
        assert c.name.replace("-", "").isalnum() and c.name == c.name.lower(), c.name
        assert c.example.strip() and c.expect.strip() and callable(c.body), c.name
    for example, where in replay.CITED:
        test_file = where.split("::")[0].split(" ")[0]
        assert example and (ROOT / test_file).is_file(), where
        if "::" in where:  # the cited test exists in that file
            name = where.split("::")[1].split(" ")[0].split("[")[0]
            assert f"def {name}(" in (ROOT / test_file).read_text().replace("_\n", "_"), name
    assert all(example and why for example, why in replay.SKIPPED)


def test_two_cheap_cases_run_clean_through_the_runner(replay, tmp_path):
    results = replay.replay_all(["tune-seed", "memory-1gib-config"], tmp_path)
    assert [r.name for r in results] == ["tune-seed", "memory-1gib-config"]
    for r in results:
        assert r.clean and r.verdict == "clean", r
        assert r.commands and all(c["rc"] not in (0, None) for c in r.commands), r
        assert all(c["last_stderr"].startswith("fedskew:") for c in r.commands), r


def test_a_traceback_or_a_hang_is_not_clean(replay, tmp_path):
    def traceback(ctx):
        ctx.run([sys.executable, "-c", "raise ValueError('boom')"], timeout=30)
        return True, "its own check passed"

    def hang(ctx):
        ctx.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
        return True, "its own check passed"

    def garbage(ctx):
        return replay.refused(ctx.run([sys.executable, "-c", "print('{}')"], timeout=30))

    verdicts = {
        name: replay.replay(replay.Case(name, "x", "y", body), tmp_path, {}).verdict
        for name, body in [("tb", traceback), ("hang", hang), ("garbage", garbage)]
    }
    assert verdicts == {
        "tb": "not clean: traceback",
        "hang": "not clean: hang past its timeout",
        "garbage": "not clean: wrong outcome",
    }
