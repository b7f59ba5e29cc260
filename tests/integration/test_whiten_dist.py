"""Masked whitening across two gloo ranks equals whitening the concatenated data in one process."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.distributed as dist

from _trainer_harness import start_ranks  # isort: skip

# Rank 0 holds two samples, rank 1 three (one fully masked, one zero-length): the ranks' local
# statistics differ a lot from the global ones, so a missing all-reduce cannot pass.
SHARDS = [
    {"lengths": [3, 2], "x": [1.0, 2.0, 3.0, 4.0, 5.0], "mask": [1, 1, 0, 1, 1], "rewards": [1.0, -1.0]},
    {"lengths": [2, 0, 3], "x": [40.0, 50.0, 60.0, 70.0, 80.0], "mask": [0, 0, 1, 1, 0], "rewards": [9.0, 0.0, 5.0]},
]
JOIN_TIMEOUT_S = 120.0


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from miles.algo.advantages import compute_advantages_and_returns
        from miles.algo.whiten import masked_whiten
        from miles.config import AlgoConfig

        shard = SHARDS[rank]
        mask = torch.tensor(shard["mask"], dtype=torch.float32)
        whitened = masked_whiten(torch.tensor(shard["x"]), mask)
        scaled = masked_whiten(torch.tensor(shard["x"]), mask, shift_mean=False)
        cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.5)
        adv, ret = compute_advantages_and_returns(
            cfg, rewards=torch.tensor(shard["rewards"]), response_lengths=shard["lengths"], loss_mask=mask
        )
        result = {"whitened": whitened.tolist(), "scaled": scaled.tolist(), "adv": adv.tolist(), "ret": ret.tolist()}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _whiten_ref(x, m, shift_mean=True):
    n = sum(m)
    mean = sum(a for a, b in zip(x, m, strict=True) if b) / n
    var = sum((a - mean) ** 2 for a, b in zip(x, m, strict=True) if b) / n
    out = [(a - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean) for a in x]
    return [o if b else 0.0 for o, b in zip(out, m, strict=True)]


def _split(values, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def test_whitening_statistics_span_both_ranks(tmp_path):
    ctx = start_ranks(_worker, (2, str(tmp_path / "rdzv"), str(tmp_path)), 2, join=False)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"gloo workers did not finish within {JOIN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    assert not any(p.is_alive() for p in ctx.processes), "a worker process was left behind"

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    all_x = SHARDS[0]["x"] + SHARDS[1]["x"]
    all_m = SHARDS[0]["mask"] + SHARDS[1]["mask"]
    got = results[0]["whitened"] + results[1]["whitened"]
    assert got == pytest.approx(_whiten_ref(all_x, all_m), abs=1e-5)
    assert results[0]["whitened"] != pytest.approx(_whiten_ref(SHARDS[0]["x"], SHARDS[0]["mask"]), abs=1e-3)
    scaled = results[0]["scaled"] + results[1]["scaled"]
    assert scaled == pytest.approx(_whiten_ref(all_x, all_m, shift_mean=False), abs=1e-5)

    # REINFORCE++ (no KL): the reward at the last trainable token, discounted by 0.5 backwards.
    returns = []
    for shard in SHARDS:
        for r, m in zip(shard["rewards"], _split(shard["mask"], shard["lengths"]), strict=True):
            trainable = [t for t, mi in enumerate(m) if mi]
            ret = [0.0] * len(m)
            if trainable:
                last = trainable[-1]
                ret = [r * 0.5 ** (last - t) if mi else 0.0 for t, mi in enumerate(m)]
            returns += ret
    assert results[0]["ret"] + results[1]["ret"] == pytest.approx(returns, abs=1e-6)
    assert results[0]["adv"] + results[1]["adv"] == pytest.approx(_whiten_ref(returns, all_m), abs=1e-5)
