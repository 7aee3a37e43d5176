"""Student-t intervals of paired differences (fedskew.report.intervals), checked against
printed t tables and arithmetic done by hand here."""

from __future__ import annotations

import math

import pytest

from fedskew.report.intervals import central_probability, paired_summary, t_quantile

# t(0.975, df) from a printed table of Student's t (two-sided 95 %), to 4 decimals.
T_TABLE = {
    1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646,
    9: 2.2622, 10: 2.2281, 19: 2.0930, 29: 2.0452, 30: 2.0423,
}  # fmt: skip


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.95, df) == pytest.approx(T_TABLE[df], abs=5e-5)


def test_other_levels_and_the_inverse():
    assert t_quantile(0.90, 4) == pytest.approx(2.1318, abs=5e-5)  # t(0.95, 4)
    assert t_quantile(0.99, 2) == pytest.approx(9.9248, abs=5e-5)  # t(0.995, 2)
    # df = 2 has P(|T| < t) = t / sqrt(2 + t^2) in closed form.
    assert central_probability(1.5, 2) == pytest.approx(1.5 / math.sqrt(2 + 1.5**2), abs=1e-12)
    for df in (1, 2, 3, 8, 25):
        assert central_probability(t_quantile(0.95, df), df) == pytest.approx(0.95, abs=1e-12)
    with pytest.raises(ValueError):
        t_quantile(0.95, 0)


def test_interval_of_three_paired_differences_by_hand():
    # diffs +1, +2, -1: mean 2/3; deviations 1/3, 4/3, -5/3; s^2 = (1 + 16 + 25) / 9 / 2.
    s = math.sqrt(42 / 18)
    half = 4.3027 * s / math.sqrt(3)
    p = paired_summary([1.0, 2.0, -1.0])
    assert p is not None
    assert (p.n, p.ahead) == (3, 2)
    assert p.mean == pytest.approx(2 / 3)
    assert p.std == pytest.approx(s)
    assert p.low == pytest.approx(2 / 3 - half, abs=1e-4)
    assert p.high == pytest.approx(2 / 3 + half, abs=1e-4)
    assert not p.excludes_zero
    assert p.markdown() == "+0.67 [-3.13, +4.46]; ahead in 2/3 seeds"


def test_interval_of_four_differences_that_exclude_zero():
    # 2, 3, 2.5, 3.5: mean 2.75; squares of deviations .5625 .0625 .0625 .5625 -> s^2 = 1.25/3.
    s = math.sqrt(1.25 / 3)
    half = 3.1824 * s / 2
    p = paired_summary([2.0, 3.0, 2.5, 3.5])
    assert p is not None and p.low is not None and p.high is not None
    assert (p.low, p.high) == pytest.approx((2.75 - half, 2.75 + half), abs=1e-4)
    assert p.excludes_zero and p.ahead == 4


def test_one_seed_has_no_interval_and_none_has_no_summary():
    p = paired_summary([-0.5])
    assert p is not None
    assert (p.low, p.high, p.std, p.ahead) == (None, None, None, 0)
    assert p.markdown() == "-0.50 (1 seed: no interval); ahead in 0/1 seed"
    assert not p.excludes_zero
    assert paired_summary([]) is None
