"""Token balance of `split_by_dp` (Karmarkar–Karp, equal sample counts) vs round-robin `i::dp`.

Response lengths are drawn log-normal (long-tailed, as RL rollouts are). For each setting the
script reports the straggler factor max(rank tokens) / mean(rank tokens) of both splits over
several seeds (medians) and the time the balanced split takes; it ends with one JSON line.

    python bench/bench_dp_split.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from miles.rollout.train_data import TrainBatch, split_by_dp


def _batch(lengths: np.ndarray) -> TrainBatch:
    return TrainBatch.unscored(np.zeros(int(lengths.sum()), np.int64), lengths, lengths, group_size=8)


def _straggler(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    results = {}
    for batch_size, dp_size in [(256, 8), (1024, 8), (4096, 32)]:
        kk, rr, secs = [], [], []
        for seed in range(5):
            lengths = np.clip(np.random.default_rng(seed).lognormal(7.0, 0.9, batch_size), 16, 16384).astype(np.int64)
            batch = _batch(lengths)
            t0 = time.perf_counter()
            shards = split_by_dp(batch, dp_size)
            secs.append(time.perf_counter() - t0)
            kk.append(_straggler([s.num_tokens for s in shards]))
            rr.append(_straggler([int(lengths[r::dp_size].sum()) for r in range(dp_size)]))
        key = f"B{batch_size}_dp{dp_size}"
        results[key] = {
            "balanced_straggler": round(statistics.median(kk), 5),
            "round_robin_straggler": round(statistics.median(rr), 5),
            "split_ms": round(1e3 * statistics.median(secs), 2),
        }
        print(
            f"{key}: straggler balanced {results[key]['balanced_straggler']:.4f} vs round-robin "
            f"{results[key]['round_robin_straggler']:.4f}; split {results[key]['split_ms']} ms"
        )
    print(json.dumps({"bench": "dp_split", **results}))


if __name__ == "__main__":
    main()
