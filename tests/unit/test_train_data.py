"""Samples -> TrainBatch conversion and the token-balanced data-parallel split."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import TrainBatch, reward_value, samples_to_train_batch, split_by_dp


def _sample(i: int, group: int, prompt_len: int, resp_len: int, reward, **kw) -> Sample:
    s = Sample(
        tokens=list(range(100 * i, 100 * i + prompt_len + resp_len)),
        response_length=resp_len,
        reward=reward,
        group_index=group,
        index=i,
        status=kw.pop("status", SampleStatus.COMPLETED),
        **kw,
    )
    s.validate()
    return s


def _convert(samples, **kw) -> TrainBatch:
    opts = dict(reward_key=None, estimator="grpo", std_normalization=True, disable_rewards_normalization=False)
    opts.update(kw)
    return samples_to_train_batch(samples, **opts)


def test_columns_layout_and_values() -> None:
    samples = [
        _sample(0, 0, 2, 3, 1.0, loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, -0.2, -0.3], weight_versions=[4, 4, 5]),
        _sample(
            1, 0, 1, 2, 0.0, rollout_log_probs=[-1.0, -2.0], weight_versions=[5, 5], status=SampleStatus.TRUNCATED
        ),
    ]
    batch = _convert(samples)
    np.testing.assert_array_equal(batch.tokens, [0, 1, 2, 3, 4, 100, 101, 102])
    np.testing.assert_array_equal(batch.seq_lens, [5, 3])
    np.testing.assert_array_equal(batch.response_lengths, [3, 2])
    np.testing.assert_array_equal(batch.loss_masks, [1, 0, 1, 1, 1])  # None -> all ones
    np.testing.assert_allclose(batch.rollout_log_probs, [-0.1, -0.2, -0.3, -1.0, -2.0])
    np.testing.assert_array_equal(batch.weight_versions, [4, 4, 5, 5, 5])
    assert batch.teacher_log_probs is None
    np.testing.assert_array_equal(batch.truncated, [0, 1])
    np.testing.assert_array_equal(batch.group_index, [0, 0])
    np.testing.assert_array_equal(batch.sample_index, [0, 1])
    np.testing.assert_array_equal(batch.raw_rewards, [1.0, 0.0])
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / (0.7071068 + 1e-6)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(batch.rewards, [expected, -expected], rtol=1e-6)
    assert batch.loss_masks.dtype == np.float32 and batch.tokens.dtype == np.int64


def test_missing_per_token_column_is_none_for_the_batch() -> None:
    samples = [_sample(0, 0, 1, 2, 1.0, rollout_log_probs=[-1.0, -1.0]), _sample(1, 0, 1, 2, 0.0)]
    assert _convert(samples).rollout_log_probs is None


def test_removed_sample_keeps_reward_for_normalisation_but_no_loss() -> None:
    samples = [_sample(i, 0, 1, 2, r) for i, r in enumerate([1.0, 0.0, 0.0])]
    samples[0].remove_sample = True
    batch = _convert(samples, estimator="reinforce_plus_plus_baseline")
    np.testing.assert_array_equal(batch.loss_masks, [0, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(batch.rewards, [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)  # mean over all three


def test_dict_rewards_need_reward_key() -> None:
    samples = [_sample(0, 0, 1, 1, {"acc": 1.0, "fmt": 0.5}), _sample(1, 0, 1, 1, {"acc": 0.0, "fmt": 0.5})]
    batch = _convert(samples, reward_key="fmt", estimator="ppo")
    np.testing.assert_array_equal(batch.raw_rewards, [0.5, 0.5])
    with pytest.raises(ValueError, match="set --reward-key"):
        _convert(samples)
    with pytest.raises(ValueError, match="'nope' not in reward keys"):
        reward_value(samples[0], "nope")
    with pytest.raises(ValueError, match="has no reward"):
        reward_value(Sample(index=3, status=SampleStatus.FAILED), None)


def test_inconsistent_sample_is_rejected() -> None:
    bad = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1], reward=1.0, group_index=0, index=0)
    with pytest.raises(ValueError, match="len\\(loss_mask\\)=1 != response_length=2"):
        _convert([bad])


# ---- data-parallel split -------------------------------------------------------------------


def _batch_with_lengths(lengths: list[int]) -> TrainBatch:
    samples = [_sample(i, i // 2, n - 1, 1, float(i % 2)) for i, n in enumerate(lengths)]
    return _convert(samples)


def _best_max_load(lengths: list[int], k: int) -> int:
    """Brute force: the smallest possible max token load over equal-size k-way splits (k = 2)."""
    assert k == 2
    n = len(lengths)
    best = sum(lengths)
    for left in itertools.combinations(range(n), n // 2):
        load = sum(lengths[i] for i in left)
        best = min(best, max(load, sum(lengths) - load))
    return best


def test_split_equal_counts_cover_everything_and_keep_order() -> None:
    lengths = [50, 3, 7, 40, 8, 9, 30, 2, 5, 6, 20, 4]
    batch = _batch_with_lengths(lengths)
    shards = split_by_dp(batch, 3)
    assert [len(s) for s in shards] == [4, 4, 4]
    seen = np.concatenate([s.sample_index for s in shards])
    assert sorted(seen.tolist()) == list(range(12))
    for shard in shards:
        assert list(shard.sample_index) == sorted(shard.sample_index)  # batch order inside a shard
        for seq, i in zip(shard.sequences(), shard.sample_index, strict=True):
            np.testing.assert_array_equal(seq, batch.sequences()[i])
        np.testing.assert_array_equal(shard.rewards, batch.rewards[shard.sample_index])
    loads = [s.num_tokens for s in shards]
    round_robin = [sum(lengths[r::3]) for r in range(3)]
    assert max(loads) - min(loads) < max(round_robin) - min(round_robin)
    assert max(loads) - min(loads) <= max(lengths) // 2


@pytest.mark.parametrize("seed", range(5))
def test_split_is_close_to_optimal_on_small_cases(seed: int) -> None:
    lengths = np.random.default_rng(seed).integers(1, 200, size=10).tolist()
    shards = split_by_dp(_batch_with_lengths(lengths), 2)
    best = _best_max_load(lengths, 2)
    assert max(s.num_tokens for s in shards) <= 1.01 * best


def test_split_is_deterministic_and_checks_divisibility() -> None:
    batch = _batch_with_lengths([5, 9, 2, 7, 7, 1, 3, 8])
    first = [s.sample_index.tolist() for s in split_by_dp(batch, 4)]
    assert first == [s.sample_index.tolist() for s in split_by_dp(batch, 4)]
    assert split_by_dp(batch, 1)[0] is batch
    with pytest.raises(ValueError, match="not divisible by dp_size=3"):
        split_by_dp(batch, 3)


def test_split_balances_long_tailed_lengths() -> None:
    # 256 log-normal lengths over 8 ranks: round-robin leaves a rank ~27% above the mean; the
    # balanced split must come within 0.1% of the mean (the lower bound on the max load).
    lengths = np.clip(np.random.default_rng(0).lognormal(7.0, 0.9, 256), 16, 16384).astype(np.int64)
    batch = _batch_with_lengths(lengths.tolist())
    loads = [s.num_tokens for s in split_by_dp(batch, 8)]
    assert max(loads) <= 1.001 * lengths.sum() / 8
    assert max(sum(lengths[r::8]) for r in range(8)) > 1.05 * lengths.sum() / 8


def test_an_unscored_batch_trains_every_response_token_with_zero_rewards():
    batch = TrainBatch.unscored(np.arange(9), [4, 5], [2, 3], group_size=2, rollout_log_probs=np.zeros(5, np.float32))
    assert batch.tokens.dtype == np.int64 and batch.seq_lens.tolist() == [4, 5] and batch.num_tokens == 9
    assert batch.loss_masks.tolist() == [1.0] * 5 and not batch.rewards.any() and not batch.truncated.any()
    assert batch.group_index.tolist() == [0, 0] and batch.sample_index.tolist() == [0, 1]
    assert batch.rollout_log_probs.shape == (5,)
