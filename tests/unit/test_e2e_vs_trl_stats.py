"""bench/e2e_stats.py: the paired reading of learning: per-seed differences, their mean and a 95% t-interval."""

from __future__ import annotations

import pytest

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)


@pytest.fixture(scope="module")
def bench():
    return load_bench("e2e_stats")


def _runs(*last5: float) -> list[dict]:
    return [{"rewards": [0.0] * 25 + [x] * 5} for x in last5]


def test_paired_differences_and_their_interval(bench):
    # the H200 call of bench/results/e2e_vs_trl.md: miles 0.588, 0.592, 0.620 against TRL 0.596, 0.609, 0.652
    got = bench.paired_last5(_runs(0.5883, 0.5922, 0.6203), _runs(0.5961, 0.6094, 0.6516))
    assert got["reward_last5_diff"] == [-0.0078, -0.0172, -0.0313]
    assert got["reward_last5_diff_mean"] == pytest.approx(-0.0188, abs=1e-4)
    # sd 0.01183 over 3 seeds, t(2) = 4.303: half-width 4.303 * 0.01183 / sqrt(3)
    assert got["reward_last5_diff_ci95"] == pytest.approx(0.0294, abs=1e-4)


def test_one_seed_has_no_interval(bench):
    got = bench.paired_last5(_runs(0.6), _runs(0.5))
    assert got["reward_last5_diff"] == [0.1] and got["reward_last5_diff_ci95"] is None


def test_t_quantiles(bench):
    assert bench.t975(2) == 4.303 and bench.t975(10) == 2.228
    assert bench.t975(20) == pytest.approx(2.086, abs=0.01) and bench.t975(120) == pytest.approx(1.980, abs=0.01)
