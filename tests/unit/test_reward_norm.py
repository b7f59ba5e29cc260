"""Group reward normalisation by group_index, checked against hand-computed values and a loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from miles.algo.reward_norm import normalize_group_rewards


def _loop_reference(rewards, groups, *, divide: bool) -> list[float]:
    """Independent reference: one Python loop per group, statistics by hand."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        values = [rewards[i] for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        for i in members:
            out[i] = rewards[i] - mean
            if divide and len(values) > 1 and std > 0:
                out[i] /= std + 1e-6
    return out


def test_grpo_hand_computed() -> None:
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.5 / 0.5773513
    out = normalize_group_rewards(
        np.array([1.0, 0.0, 0.0, 1.0]), np.array([3, 3, 3, 3]), estimator="grpo", std_normalization=True
    )
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(out, [expected, -expected, -expected, expected], rtol=1e-6)
    assert out.dtype == np.float32


def test_uneven_interleaved_and_singleton_groups() -> None:
    rewards = [1.0, 0.0, 5.0, 0.5, 1.0, 2.0, 7.0, 0.0, 1.0]
    groups = [10, 20, 30, 10, 20, 10, 40, 20, 20]  # sizes 3, 4, 1, 1; interleaved, not contiguous
    out = normalize_group_rewards(np.array(rewards), np.array(groups), estimator="gspo", std_normalization=True)
    np.testing.assert_allclose(out, _loop_reference(rewards, groups, divide=True), rtol=1e-5, atol=1e-6)
    assert out[2] == 0.0 and out[6] == 0.0  # singletons: centred to zero, no division by a zero std
    # A reshape into [groups, n] would mix groups 10 and 20; check one value by hand:
    # group 10 = [1, 0.5, 2]: mean 7/6, std sqrt(((-1/6)^2 + (-2/3)^2 + (5/6)^2) / 2) = sqrt(7/12)
    assert out[0] == pytest.approx((1 - 7 / 6) / (math.sqrt(7 / 12) + 1e-6), rel=1e-5)


def test_zero_std_group_is_centred_only() -> None:
    out = normalize_group_rewards(
        np.array([2.0, 2.0, 2.0]), np.zeros(3, np.int64), estimator="grpo", std_normalization=True
    )
    np.testing.assert_array_equal(out, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "reinforce_plus_plus_baseline"])
def test_centering_only(estimator: str) -> None:
    rewards, groups = [1.0, 0.0, 0.0, 3.0, 1.0], [0, 0, 0, 1, 1]
    # rpp_baseline never divides; grpo/gspo don't when std normalisation is off (Dr.GRPO)
    out = normalize_group_rewards(np.array(rewards), np.array(groups), estimator=estimator, std_normalization=False)
    np.testing.assert_allclose(out, [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0], rtol=1e-6)
    if estimator == "reinforce_plus_plus_baseline":
        with_std = normalize_group_rewards(
            np.array(rewards), np.array(groups), estimator=estimator, std_normalization=True
        )
        np.testing.assert_array_equal(with_std, out)


@pytest.mark.parametrize(("estimator", "disabled"), [("ppo", False), ("reinforce_plus_plus", False), ("grpo", True)])
def test_raw_rewards(estimator: str, disabled: bool) -> None:
    rewards = np.array([1.0, 0.0, 0.25])
    out = normalize_group_rewards(
        rewards, np.array([0, 0, 0]), estimator=estimator, std_normalization=True, disabled=disabled
    )
    np.testing.assert_array_equal(out, rewards.astype(np.float32))


def test_errors() -> None:
    with pytest.raises(ValueError, match="unknown advantage_estimator 'grpoo'"):
        normalize_group_rewards(np.zeros(2), np.zeros(2), estimator="grpoo", std_normalization=True)
    with pytest.raises(ValueError, match="must be equal"):
        normalize_group_rewards(np.zeros(2), np.zeros(3), estimator="grpo", std_normalization=True)


def test_empty_batch() -> None:
    out = normalize_group_rewards(np.zeros(0), np.zeros(0, np.int64), estimator="grpo", std_normalization=True)
    assert out.shape == (0,)
