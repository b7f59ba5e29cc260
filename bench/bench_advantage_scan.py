"""Chunked discounted scan (GAE / REINFORCE++ returns) vs the per-step backward loop.

Both compute y_t = x_t + d·y_{t+1} over [B, L]; the baseline loops over L in Python with one
vectorised op per step over the batch. Reports medians over several repetitions, measured side
by side, the max abs difference, and ends with one JSON line.

    PYTHONPATH=. python bench/bench_advantage_scan.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from miles.algo.advantages import discounted_reverse_cumsum


def _loop(x: torch.Tensor, discount: float) -> torch.Tensor:
    out = torch.empty_like(x)
    carry = torch.zeros(x.shape[0], dtype=x.dtype)
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + discount * carry
        out[:, t] = carry
    return out


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    for batch, length in [(64, 1024), (64, 8192), (8, 32768)]:
        x = torch.randn(batch, length, generator=torch.Generator().manual_seed(0))
        loop_s = _median_s(lambda x=x: _loop(x, 0.95), reps=5)
        scan_s = _median_s(lambda x=x: discounted_reverse_cumsum(x, 0.95), reps=5)
        err = (discounted_reverse_cumsum(x, 0.95) - _loop(x, 0.95)).abs().max().item()
        key = f"B{batch}_L{length}"
        results[key] = {
            "loop_ms": loop_s * 1e3,
            "scan_ms": scan_s * 1e3,
            "speedup": loop_s / scan_s,
            "max_abs_err": err,
        }
        print(
            f"{key}: loop {loop_s * 1e3:.1f} ms, chunked scan {scan_s * 1e3:.1f} ms, "
            f"x{loop_s / scan_s:.1f}, max |diff| {err:.2e}"
        )
    print(json.dumps({"bench": "advantage_scan", "threads": 1, "results": results}))


if __name__ == "__main__":
    main()
