"""Column-oriented training data: what crosses from rollout to the trainer.

Every per-sample column has B entries; every per-token column is the concatenation, over the
samples in order, of their *response* tokens (sum(response_lengths) entries). `tokens` is the
concatenation of full sequences (prompt + response; sum(seq_lens) entries). Arrays are numpy so
the RPC codec ships them as out-of-band frames, never as per-sample Python objects.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, fields

import numpy as np

from miles.algo.reward_norm import normalize_group_rewards
from miles.rollout.sample import Sample, SampleStatus

_PER_SAMPLE = ("seq_lens", "response_lengths", "rewards", "raw_rewards", "group_index", "sample_index", "truncated")
_PER_TOKEN = ("loss_masks", "rollout_log_probs", "weight_versions", "teacher_log_probs", "opd_reverse_kl")


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + length) for every pair, without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + offsets


@dataclass(slots=True)
class TrainBatch:
    tokens: np.ndarray  # int64 [sum(seq_lens)]
    seq_lens: np.ndarray  # int64 [B]
    response_lengths: np.ndarray  # int64 [B]
    loss_masks: np.ndarray  # float32 [sum(response_lengths)]
    rewards: np.ndarray  # float32 [B], normalised per group (what the estimator uses)
    raw_rewards: np.ndarray  # float32 [B], as the reward function returned them
    group_index: np.ndarray  # int64 [B]
    sample_index: np.ndarray  # int64 [B]
    truncated: np.ndarray  # int8 [B]
    rollout_log_probs: np.ndarray | None = None  # float32 [sum(response_lengths)]
    weight_versions: np.ndarray | None = None  # int64 [sum(response_lengths)]
    teacher_log_probs: np.ndarray | None = None  # float32 [sum(response_lengths)]
    opd_reverse_kl: np.ndarray | None = None  # float32 [sum(response_lengths)], top-K OPD
    # R3: uint8/uint16 [sum(seq_lens - 1), moe_layers, k], each sample's rows for its tokens but the last
    routed_experts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def to_dict(self) -> dict[str, np.ndarray | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, np.ndarray | None]) -> TrainBatch:
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})

    @classmethod
    def unscored(cls, tokens, seq_lens, response_lengths, group_size: int = 1, **columns) -> TrainBatch:
        """A batch whose every response token is trained on, with zero rewards, none truncated and samples in
        groups of `group_size` (benches and tests of the trainer's speed or numerics, not of learning);
        `columns` sets the optional ones (rollout log-probs, routed experts, ...)."""
        seq_lens, response_lengths = np.asarray(seq_lens, np.int64), np.asarray(response_lengths, np.int64)
        b = len(seq_lens)
        return cls(
            tokens=np.asarray(tokens, np.int64),
            seq_lens=seq_lens,
            response_lengths=response_lengths,
            loss_masks=np.ones(int(response_lengths.sum()), np.float32),
            rewards=np.zeros(b, np.float32),
            raw_rewards=np.zeros(b, np.float32),
            group_index=np.arange(b) // group_size,
            sample_index=np.arange(b),
            truncated=np.zeros(b, np.int8),
            **columns,
        )

    def sequences(self) -> list[np.ndarray]:
        """Full token sequences, one array per sample."""
        return np.split(self.tokens, np.cumsum(self.seq_lens)[:-1]) if len(self) else []

    def routed_per_sample(self) -> list[np.ndarray]:
        """`routed_experts` split into one [seq_len - 1, layers, k] array per sample."""
        if self.routed_experts is None or not len(self):
            return []
        return np.split(self.routed_experts, np.cumsum(np.maximum(self.seq_lens - 1, 0))[:-1])

    def per_token(self, name: str) -> list[np.ndarray]:
        """Split a per-token column into one array per sample."""
        col = getattr(self, name)
        return np.split(col, np.cumsum(self.response_lengths)[:-1]) if len(self) else []

    def select(self, idx: list[int] | np.ndarray) -> TrainBatch:
        """A new batch with samples `idx`, in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        tok_sel = _ranges(np.concatenate([[0], np.cumsum(self.seq_lens)])[idx], self.seq_lens[idx])
        routed_rows = np.maximum(self.seq_lens - 1, 0)
        routed_sel = _ranges(np.concatenate([[0], np.cumsum(routed_rows)])[idx], routed_rows[idx])
        rsp_sel = _ranges(np.concatenate([[0], np.cumsum(self.response_lengths)])[idx], self.response_lengths[idx])
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name == "tokens":
                out[f.name] = v[tok_sel]
            elif f.name == "routed_experts":
                out[f.name] = v[routed_sel]
            elif f.name in _PER_TOKEN:
                out[f.name] = v[rsp_sel]
            else:
                out[f.name] = v[idx]
        return TrainBatch(**out)


# ---- conversion from rewarded samples ------------------------------------------------------


def reward_value(sample: Sample, reward_key: str | None) -> float:
    """The scalar reward of a sample; a dict reward is reduced with `--reward-key`."""
    reward = sample.reward
    if reward is None:
        raise ValueError(
            f"sample {sample.index} (status {sample.status.value}) has no reward; "
            "drop FAILED/ABORTED samples before converting or scoring"
        )
    if isinstance(reward, dict):
        if reward_key is None:
            raise ValueError(f"sample {sample.index}: reward is a dict with keys {sorted(reward)}; set --reward-key")
        if reward_key not in reward:
            raise ValueError(f"sample {sample.index}: --reward-key {reward_key!r} not in reward keys {sorted(reward)}")
        reward = reward[reward_key]
    return float(reward)


def _per_token_column(samples: list[Sample], name: str, dtype: type) -> np.ndarray | None:
    """Concatenate a per-token list over samples; None when any sample with a response lacks it."""
    values = [getattr(s, name) for s in samples]
    if any((v is None or len(v) == 0) and s.response_length > 0 for s, v in zip(samples, values, strict=True)):
        return None
    return np.concatenate([np.asarray(v or [], dtype=dtype) for v in values]) if samples else np.zeros(0, dtype)


def _loss_mask(sample: Sample) -> np.ndarray:
    if sample.remove_sample:  # kept for group normalisation, contributes no gradient
        return np.zeros(sample.response_length, np.float32)
    if sample.loss_mask is None:
        return np.ones(sample.response_length, np.float32)
    return np.asarray(sample.loss_mask, dtype=np.float32)


def _ids(samples: list[Sample], name: str) -> np.ndarray:
    values = [getattr(s, name) for s in samples]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ValueError(
            f"{len(missing)} samples (first at position {missing[0]}) have no {name}; the data source sets it"
        )
    return np.asarray(values, dtype=np.int64)


def samples_to_train_batch(
    samples: list[Sample],
    *,
    reward_key: str | None,
    estimator: str,
    std_normalization: bool,
    disable_rewards_normalization: bool,
) -> TrainBatch:
    """Columnar train data from rewarded samples, with rewards normalised per `group_index`.

    `loss_mask=None` means all ones; a sample with `remove_sample` keeps its reward (it still
    counts in its group's mean and std) but its loss mask is zeroed. A per-token column that any
    sample lacks is None for the whole batch rather than filled with made-up values.
    """
    for sample in samples:
        sample.validate()
    group_index = _ids(samples, "group_index")
    raw = np.asarray([reward_value(s, reward_key) for s in samples], dtype=np.float64)
    rewards = normalize_group_rewards(
        raw,
        group_index,
        estimator=estimator,
        std_normalization=std_normalization,
        disabled=disable_rewards_normalization,
    )
    tokens = [np.asarray(s.tokens, dtype=np.int64) for s in samples]
    return TrainBatch(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
        seq_lens=np.asarray([len(s.tokens) for s in samples], dtype=np.int64),
        response_lengths=np.asarray([s.response_length for s in samples], dtype=np.int64),
        loss_masks=np.concatenate([_loss_mask(s) for s in samples]) if samples else np.zeros(0, np.float32),
        rewards=rewards,
        raw_rewards=raw.astype(np.float32),
        group_index=group_index,
        sample_index=_ids(samples, "index"),
        truncated=np.asarray([s.status == SampleStatus.TRUNCATED for s in samples], dtype=np.int8),
        rollout_log_probs=_per_token_column(samples, "rollout_log_probs", np.float32),
        weight_versions=_per_token_column(samples, "weight_versions", np.int64),
        teacher_log_probs=_per_token_column(samples, "teacher_log_probs", np.float32),
        opd_reverse_kl=_per_token_column(samples, "opd_reverse_kl", np.float32),
        routed_experts=_routed_column(samples),
    )


def _routed_column(samples: list[Sample]) -> np.ndarray | None:
    """The samples' routed experts back to back; None when any sample has none (the trainer then refuses R3)."""
    routed = [s.rollout_routed_experts for s in samples]
    if not samples or any(r is None for r in routed):
        return None
    return np.concatenate(routed)


# ---- data-parallel split ---------------------------------------------------------------------


def _balanced_equal_size_partition(weights: np.ndarray, k: int) -> list[list[int]]:
    """k subsets of len(weights)/k items each with near-equal weight sums (Karmarkar–Karp).

    Items are sorted and cut into rows of k; each row starts as a k-way partial partition (one
    item per subset). Repeatedly the two partial partitions with the largest spread are merged,
    pairing the heaviest subset of one with the lightest of the other, which keeps every subset
    the same size. Ties break on a counter, so the result is deterministic.
    """
    order = sorted(range(len(weights)), key=lambda i: (int(weights[i]), i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, start in enumerate(range(0, len(order), k)):
        subsets = sorted(((int(weights[i]), [i]) for i in order[start : start + k]), key=lambda t: (-t[0], t[1]))
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), counter, subsets))
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda t: (-t[0], min(t[1])))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(k)]


def _refine_by_swaps(weights: np.ndarray, parts: list[list[int]], max_rounds: int = 1000) -> list[list[int]]:
    """Swap one item between the heaviest and the lightest subset while that narrows their gap.

    KK leaves a few percent of imbalance on long-tailed lengths with few items per rank; a
    swap of weights w_i > w_j with w_i - w_j closest to half the gap removes most of it. Every
    swap strictly lowers the sum of squared loads, so the loop ends; sizes never change.
    """
    parts = [list(p) for p in parts]
    loads = [int(weights[p].sum()) for p in parts]
    for _ in range(max_rounds):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        light = sorted(parts[lo], key=lambda j: (int(weights[j]), j))
        light_w = [int(weights[j]) for j in light]
        best: tuple[float, int, int, int] | None = None
        for i in parts[hi]:
            k = bisect.bisect_left(light_w, int(weights[i]) - gap / 2)
            for kk in (k - 1, k):
                if 0 <= kk < len(light) and 0 < (d := int(weights[i]) - light_w[kk]) < gap:
                    if best is None or abs(gap - 2 * d) < best[0]:
                        best = (abs(gap - 2 * d), i, light[kk], d)
        if best is None:
            break
        _, i, j, d = best
        parts[hi][parts[hi].index(i)] = j
        parts[lo][parts[lo].index(j)] = i
        loads[hi] -= d
        loads[lo] += d
    return [sorted(p) for p in parts]


def split_by_dp(batch: TrainBatch, dp_size: int) -> list[TrainBatch]:
    """One shard per data-parallel rank: equal sample counts, token counts balanced
    (Karmarkar–Karp, then pairwise swaps). Deterministic for a given batch.

    Within a shard samples keep their batch order.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if len(batch) % dp_size:
        raise ValueError(
            f"batch of {len(batch)} samples is not divisible by dp_size={dp_size}; "
            f"make rollout_batch_size * n_samples_per_prompt a multiple of {dp_size}"
        )
    if dp_size == 1:
        return [batch]
    parts = _refine_by_swaps(batch.seq_lens, _balanced_equal_size_partition(batch.seq_lens, dp_size))
    parts.sort(key=lambda idx: idx[0] if idx else -1)  # rank order follows the batch order
    return [batch.select(idx) for idx in parts]
