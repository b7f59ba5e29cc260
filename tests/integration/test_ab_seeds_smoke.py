"""bench/ab_seeds.py on CPU with the tiny demo: both arms of every seed run, with the seed's flags, and
the summary pairs B against A seed by seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e_helpers import REPO, python_path  # isort: skip


@pytest.mark.timeout(600)
def test_two_arms_over_two_seeds_are_paired_seed_by_seed(tmp_path):
    cmd = [
        sys.executable,
        "bench/ab_seeds.py",
        "--config",
        "launch/configs/demo_cpu.yaml",
        "--a",
        "--lr 1e-3",
        "--b",
        "--lr 3e-3",
        "--seeds",
        "2",
        "--concurrent",
        "2",
        "--extra",
        "--num-rollout 2 --eval-interval 2 --rollout-batch-size 4 --global-batch-size 32",
        "--out-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": python_path()}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    runs, summary = lines[:-1], lines[-1]
    assert sorted((r["arm"], r["seed"]) for r in runs) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert all(r["steps"] == 2 and r["eval_last"] is not None and r["logprob_abs_diff"] is not None for r in runs)
    paired = summary["b_minus_a_reward_last5"]
    by = {(r["arm"], r["seed"]): r["reward_last5"] for r in runs}
    assert paired["diff"] == [round(by["b", k] - by["a", k], 4) for k in (0, 1)]
    assert paired["ci95"] is not None and summary["arms"]["b"]["flags"] == "--lr 3e-3"
    for arm in ("a", "b"):
        config = (tmp_path / f"{arm}-1" / "config.yaml").read_text()
        assert "rollout_seed: 43" in config and "seed: 1235" in config
        assert ("lr: 0.003" if arm == "b" else "lr: 0.001") in config
