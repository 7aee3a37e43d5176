"""Privacy by budget and at its edges (issues 48 and 50): the noise solved for a target
epsilon, the accounting method, the warnings of a guarantee that bounds little or nothing,
the final adaptive clip norm, and the settings that used to end in a traceback, an unmoved
model or a misleading error (noise 1e9, noise 0, SecAgg+ clip ranges of 1e-30 and 3e38,
noise beyond float32, every round skipped, a client diverging on DP noise)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from run_metrics import metrics

from fedskew.config import build_config
from fedskew.core.errors import Diverged, FedskewError, UsageError

dpa = pytest.importorskip("dp_accounting")

from test_privacy import cfg_of  # noqa: E402

from fedskew.metrics.privacy_accounting import (  # noqa: E402
    POISSON,
    central_epsilon,
    local_epsilon,
    noise_for_epsilon,
    reported_epsilon,
)
from fedskew.runs.loop import check_some_round_played, run  # noqa: E402

# ------------------------------------------------------------------ the accountant's edges


@pytest.mark.parametrize("noise", [1e9, 1e20, 3.0e38])
def test_huge_noise_gives_a_tiny_epsilon_not_a_math_domain_error(noise):
    # The accountant's bound for sampling without replacement failed with "math domain
    # error" at z = 1e9; the Gaussian mechanism alone still bounds the round.
    eps = central_epsilon(noise, 20, 8, 3, 1e-5)
    assert eps is not None and 0.0 <= eps < 1e-3
    assert central_epsilon(noise, 20, 8, 3, 1e-5, POISSON) == pytest.approx(0.0, abs=1e-3)


def test_a_run_at_noise_1e9_finishes_and_reports_its_epsilon(tmp_path):
    cfg = cfg_of(tmp_path, dp="central", dp_noise=1e9, num_clients=20, clients_per_round=8,
                 rounds=1)  # fmt: skip
    folder, summary = run(cfg)
    assert 0.0 <= summary["dp_epsilon"] < 1e-3
    assert metrics(folder)[-1]["dp_epsilon"] == summary["dp_epsilon"]


def test_noise_beyond_float32_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="makes float32 updates infinite"):
        cfg_of(tmp_path, dp="local", dp_noise=1e38)
    with pytest.raises(UsageError, match="makes float32 updates infinite"):
        cfg_of(tmp_path, dp="central", dp_noise=1e30, dp_clip=1e10)


# ------------------------------------------------------------------ no noise, weak guarantees


def test_noise_0_says_there_is_no_privacy(tmp_path, caplog):
    from fedskew.apps.cli import format_summary

    with caplog.at_level(logging.WARNING):
        folder, summary = run(cfg_of(tmp_path, dp="central", dp_noise=0.0, rounds=1))
    assert any("no differential privacy (epsilon is infinite)" in r.message
               for r in caplog.records)  # fmt: skip
    assert summary["dp_epsilon"] is None
    assert summary["dp_guarantee"].startswith("none")
    assert "NO PRIVACY: epsilon infinite" in format_summary(summary, folder)


def test_report_says_a_run_without_noise_has_infinite_epsilon(tmp_path):
    # A --dp-noise 0 run logs dp_epsilon null, so the report's privacy column used to be
    # left out altogether, as if the run had not been a DP run; it must say infinity.
    from fedskew.apps.cli import main

    run(cfg_of(tmp_path / "none", dp="central", dp_noise=0.0, rounds=1))
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "none"), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "privacy spent (DP epsilon)" in md and "∞ (noise 0)" in md
    assert "∞ (noise 0)" in (out / "report.html").read_text()


def test_a_meaninglessly_large_epsilon_is_warned_before_the_run(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        run(cfg_of(tmp_path, dp="local", dp_noise=0.2, rounds=1))
    warned = [r.message for r in caplog.records if "bounds little" in r.message]
    assert len(warned) == 1 and "local DP will spend epsilon" in warned[0]


# ------------------------------------------------------------------ target epsilon


@pytest.mark.parametrize("mode", ["central", "local"])
@pytest.mark.parametrize("method", ["replace-one", POISSON])
def test_target_epsilon_solves_for_the_noise_the_run_then_spends(tmp_path, mode, method):
    cfg = cfg_of(tmp_path, dp=mode, dp_target_epsilon=4.0, dp_accounting=method,
                 num_clients=10, clients_per_round=3, rounds=3)  # fmt: skip
    assert cfg.dp_noise != 1.0
    folder, summary = run(cfg)
    # the whole budget is spent, not more (calibration's tolerance on the noise: 1e-4)
    assert 3.99 <= summary["dp_epsilon"] <= 4.0
    assert summary["dp_target_epsilon"] == 4.0 and summary["dp_accounting"] == method
    resolved = json.loads((folder / "config.json").read_text())["resolved"]
    facts = resolved["privacy_accounting"]
    assert facts["method"] == method and facts["noise_from_target_epsilon"] == 4.0
    assert facts["adjacency"].startswith("add or remove" if method == POISSON else "replace")
    # the saved configuration (noise and target both) reads back as the same run
    from fedskew.runs.folder import saved_config

    assert saved_config(folder).dp_noise == cfg.dp_noise


def test_target_epsilon_refusals(tmp_path):
    with pytest.raises(UsageError, match="not both"):
        build_config({}, dict(dp="central", dp_target_epsilon=3.0, dp_noise=2.0))
    with pytest.raises(UsageError, match="needs dp central or local"):
        cfg_of(tmp_path, dp_target_epsilon=3.0)
    with pytest.raises(UsageError, match="must be > 0"):
        cfg_of(tmp_path, dp="local", dp_target_epsilon=0.0)
    with pytest.raises(UsageError, match="protects nothing"):
        cfg_of(tmp_path, dp="local", dp_target_epsilon=1e12)
    with pytest.raises(UsageError, match="dp-accounting must be one of"):
        cfg_of(tmp_path, dp="local", dp_accounting="poisson")


def test_poisson_add_remove_is_the_papers_accounting():
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.PoissonSampledDpEvent(8 / 20, dpa.GaussianDpEvent(1.0)), 30)
    assert central_epsilon(1.0, 20, 8, 30, 1e-5, POISSON) == pytest.approx(acc.get_epsilon(1e-5))
    # docs/privacy.md's comparison: the papers' number is several times smaller
    assert central_epsilon(1.0, 20, 8, 30, 1e-5) > 4 * central_epsilon(1.0, 20, 8, 30, 1e-5,
                                                                       POISSON)  # fmt: skip
    full = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    full.compose(dpa.GaussianDpEvent(1.0), 3)
    assert local_epsilon(1.0, 3, 1e-5, POISSON) == pytest.approx(full.get_epsilon(1e-5))


def test_the_solved_noise_is_the_smallest_that_meets_the_target():
    setting = dict(local=False, num_clients=100, per_round=10, rounds=50,
                   most_participations=10, delta=1e-5)  # fmt: skip
    z = noise_for_epsilon(3.0, **setting)
    assert reported_epsilon(z, **setting) <= 3.0
    assert reported_epsilon(z * 0.99, **setting) > 3.0


# ------------------------------------------------------------------ adaptive clipping


def test_the_summary_states_the_final_adaptive_clip_norm(tmp_path):
    from fedskew.apps.cli import format_summary

    cfg = cfg_of(tmp_path, dp="central", dp_clipping="adaptive", dp_noise=0.5, dp_clip=0.01)
    folder, summary = run(cfg)
    last = metrics(folder)[-1]
    # the norm after the last round's geometric step, not the norm it started with
    expected = last["dp_clip"] * math.exp(-0.2 * (last["dp_unclipped_fraction"] - 0.5))
    assert summary["dp_clip_final"] == pytest.approx(expected)
    assert summary["dp_clip_final"] > 0.01
    assert f"clip 0.01 adapted to {expected:.3g}" in format_summary(summary, folder)


def test_a_client_diverging_on_dp_noise_names_the_noise(tmp_path):
    # A clip norm of 1000 puts noise of deviation 333 on every weight of the mean update:
    # the next round's training ends in NaN. The error used to blame the client alone.
    cfg = cfg_of(tmp_path, dp="central", dp_clip=1000.0, dp_noise=1.0, rounds=4)
    with pytest.raises(Diverged, match=r"noise of deviation 333 per value on the mean update"):
        run(cfg)


# ------------------------------------------------------------------ secure aggregation


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(secagg_clip_range=3e38), "secagg-clip-range 3e\\+38 must be from 1 to 209.715"),
        (dict(secagg_clip_range=1e-30), "secagg-clip-range 1e-30 must be from 1"),
        (dict(secagg_clip_range=0.5), "must be from 1"),
        (dict(secagg_quantization=1000), "too coarse.*at least 20000"),
    ],
)
def test_secagg_ranges_that_sum_nothing_are_refused(tmp_path, extra, message):
    with pytest.raises(UsageError, match=message):
        cfg_of(tmp_path, secure_aggregation=True, **extra)
    cfg_of(tmp_path, **extra)  # without secure aggregation the range is not used


def test_the_largest_usable_clip_range_still_moves_the_model(tmp_path):
    folder, summary = run(cfg_of(tmp_path, secure_aggregation=True, secagg_clip_range=209.0,
                                 rounds=1))  # fmt: skip
    row = metrics(folder)[-1]
    assert row["train_loss"] > 0.1 and summary["final_accuracy"] > 0.2


# ------------------------------------------------------------------ every round skipped


def test_a_run_whose_every_round_was_skipped_fails():
    with pytest.raises(FedskewError, match=r"every round \(2\) was skipped"):
        check_some_round_played([{"round": 1, "skipped": 1.0}, {"round": 2, "skipped": 1.0}])
    check_some_round_played([{"round": 1, "skipped": 1.0}, {"round": 2}])
    check_some_round_played([])


def test_on_flower_a_run_whose_every_reply_is_lost_fails(tmp_path):
    """Local DP on Flower with every reply lost "finished" with the initial model; now the
    run stops with the reason (one tiny Flower run: 4 nodes, 2 rounds)."""
    pytest.importorskip("flwr")
    from flower_grid import LocalGrid

    from fedskew.apps.flower.server import serve

    grid = LocalGrid(4, drop={(r, p) for r in range(2) for p in range(4)})
    with pytest.raises(FedskewError, match=r"every round \(2\) was skipped"):
        serve(grid, cfg_of(tmp_path, dp="local", dp_noise=0.5))


@pytest.mark.parametrize("mode", ["central", "local", "secure"])
def test_on_flower_a_client_diverging_on_dp_noise_stops_the_run_as_in_process(tmp_path, mode):
    """Noise 1e9 wrecks the model in round 1; in round 2 every client's summand is NaN. In
    process the run stops there, naming the noise; on Flower each client raised, its
    ClientApp's exception came back as a 20-line traceback and a lost reply, round 2 was
    skipped and the run "finished" with exit 0 (issue 50's replay). Now a client that
    diverged says so in a one-line error reply and a round where no reply came and a client
    diverged stops the run as in process."""
    pytest.importorskip("flwr")
    from flower_grid import LocalGrid
    from flwr.app import Error
    from flwr.app import Message as FlowerMessage
    from flwr.common.constant import ErrorCode

    from fedskew.apps.flower.server import serve

    class FlowerRuntimeGrid(LocalGrid):
        """A ClientApp's exception becomes an error reply, as Flower's runtime makes it."""

        def deliver(self, msg):
            try:
                return super().deliver(msg)
            except Exception as exc:  # noqa: BLE001 - what Flower's runtime does
                reason = f"{type(exc)}:<'{exc}'>\nTraceback (most recent call last): ..."
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
                return FlowerMessage(error, reply_to=msg)

    noise = 1e30 if mode == "local" else 1e9
    extra = {"secure_aggregation": True, "clients_per_round": 3} if mode == "secure" else {}
    cfg = cfg_of(tmp_path, **{"num_clients": 4, "clients_per_round": 2, "rounds": 2, **extra},
                 dp="local" if mode == "local" else "central", dp_noise=noise)  # fmt: skip
    with pytest.raises(Diverged, match=r"round 2: .*diverged.*Under DP.*noise") as got:
        serve(FlowerRuntimeGrid(4), cfg)
    assert got.value.round == 2 and "\n" not in str(got.value)


def test_the_docs_examples_are_the_scripts_and_learn():
    """docs/privacy.md's first block runs in benchmarks/privacy_examples.py word for word,
    and the table under it is what that script wrote from its results file."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "privacy_examples", root / "benchmarks" / "privacy_examples.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = (root / "docs" / "privacy.md").read_text(encoding="utf-8")
    block = doc[doc.index("```bash") : doc.index("```\n", doc.index("```bash") + 7)]
    for command in script.EXAMPLES:
        assert f"\n{command}\n" in block
    results = json.loads(script.RESULTS.read_text(encoding="utf-8"))
    assert [r["command"] for r in results["examples"]] == list(script.EXAMPLES)
    assert script.render(results) in doc
    assert all(r["final_accuracy"] > 0.3 for r in results["examples"])  # 10 classes: 0.1


def test_the_accountant_leaves_the_logging_configuration_alone():
    """Poisson sampling's RDP logs a warning per fractional order it drops; logged before
    any handler existed, that configured the root logger, and every later fedskew line
    printed twice ("INFO:fedskew.execution:...")."""
    root = logging.getLogger()
    before = root.handlers[:]
    try:
        root.handlers[:] = []
        central_epsilon(1.2345, 20, 8, 2, 1e-5, POISSON)  # not in the cache yet
        noise_for_epsilon(2.0, local=False, num_clients=20, per_round=8, rounds=2,
                          most_participations=2, delta=1e-5, method=POISSON)  # fmt: skip
        assert root.handlers == []
    finally:
        root.handlers[:] = before
