"""Group reward normalisation, on the rollout side, before the advantage estimator.

Groups are found by `group_index`, never by reshaping into [num_groups, n_samples_per_prompt]:
a batch may hold uneven groups (filtered, partial, or multi-segment) and singletons.

    r~ = r - mean_group(r)                                  grpo, gspo, reinforce_plus_plus_baseline
    r~ = r~ / (std_unbiased_group(r) + 1e-6)                grpo, gspo, when std_normalization is on,
                                                             the group has > 1 member and std > 0
reinforce_plus_plus and ppo use raw rewards (their baselines live elsewhere).
"""

from __future__ import annotations

import numpy as np

GROUP_NORMALIZED = frozenset({"grpo", "gspo", "reinforce_plus_plus_baseline"})
STD_NORMALIZED = frozenset({"grpo", "gspo"})
RAW = frozenset({"reinforce_plus_plus", "ppo"})
_STD_EPS = 1e-6


def normalize_group_rewards(
    rewards: np.ndarray,
    group_index: np.ndarray,
    *,
    estimator: str,
    std_normalization: bool,
    disabled: bool = False,
) -> np.ndarray:
    """Per-group centred (and for grpo/gspo optionally std-scaled) rewards, float32, same order."""
    if estimator not in GROUP_NORMALIZED and estimator not in RAW:
        known = sorted(GROUP_NORMALIZED | RAW)
        raise ValueError(f"unknown advantage_estimator {estimator!r}; use one of {known}")
    r = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(group_index)
    if r.shape != groups.shape or r.ndim != 1:
        raise ValueError(f"rewards shape {r.shape} and group_index shape {groups.shape} must be equal and 1-D")
    if disabled or estimator in RAW or r.size == 0:
        return r.astype(np.float32)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=r) / counts
    centered = r - means[inverse]
    if estimator in STD_NORMALIZED and std_normalization:
        sq = np.bincount(inverse, weights=centered**2)
        std = np.sqrt(sq / np.maximum(counts - 1, 1))
        scale = np.where((counts > 1) & (std > 0), std + _STD_EPS, 1.0)
        centered = centered / scale[inverse]
    return centered.astype(np.float32)
