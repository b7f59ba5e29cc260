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


def test_a_run_reads_its_first_and_last_evaluation_and_the_gains(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from ab_seeds import read_run

    rows = [
        {"step": -1, "eval/x/reward_mean": 0.2, "eval/y/reward_mean": 0.4},  # before training
        *({"step": i, "rollout/reward_mean": 0.1 * i} for i in range(8)),
        {"step": 7, "eval/x/reward_mean": 0.5, "eval/y/reward_mean": 0.7},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = read_run(tmp_path)
    assert out["steps"] == 8 and out["eval_first"] == pytest.approx(0.3) and out["eval_last"] == pytest.approx(0.6)
    assert out["eval_gain"] == pytest.approx(0.3)
    assert out["reward_first5"] == pytest.approx(0.2) and out["reward_last5"] == pytest.approx(0.5)
    assert out["reward_gain"] == pytest.approx(0.3)
    later = [*rows[1:5], {"step": 3, "eval/x/reward_mean": 0.1}, *rows[5:]]  # no eval before training
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in later))
    out = read_run(tmp_path)
    assert out["eval_first"] is None and out["eval_gain"] is None and out["eval_last"] == pytest.approx(0.6)
