"""bench/e2e_vs_trl.py --trl-rewards: a miles-only call paired with TRL's stored per-seed lines."""

from __future__ import annotations

import json

import pytest

from bench_modules import load_bench  # isort: skip

bench = load_bench("e2e_vs_trl")
STORED = bench.REPO / "bench/results/e2e_vs_trl_short_trl_seeds.jsonl"


def _args(tmp_path, lines, **kw):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--sides", "miles", "--trl-rewards", str(path), "--steps", "3"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return bench.parse_args(argv)


def test_the_seeds_of_the_call_are_taken_from_the_file(tmp_path):
    lines = [{"side": "trl", "seed": k, "rewards": [0.1 * k] * 3} for k in range(4)]
    stored = bench.load_trl_rewards(_args(tmp_path, lines, first_seed=2, seeds=2), "cpu")
    assert [d["seed"] for d in stored] == [2, 3]
    miles = [{"rewards": [0.3, 0.3, 0.3]}, {"rewards": [0.2, 0.2, 0.2]}]
    paired = bench.paired_last5(miles, stored)
    assert paired["reward_last5_diff"] == pytest.approx([0.1, -0.1])


def test_missing_seeds_or_steps_and_a_trl_side_are_refused(tmp_path):
    lines = [{"side": "trl", "seed": 0, "rewards": [0.1] * 3}, {"side": "trl", "seed": 1, "rewards": [0.1] * 30}]
    with pytest.raises(SystemExit, match=r"seed\(s\) \[1, 2\]"):
        bench.load_trl_rewards(_args(tmp_path, lines, seeds=3), "cpu")
    args = _args(tmp_path, lines)
    args.sides = ["miles", "trl"]
    with pytest.raises(SystemExit, match="--sides miles"):
        bench.load_trl_rewards(args, "cpu")


def test_the_stored_h200_runs_cover_seeds_0_to_5():
    stored = bench.load_trl_rewards(
        bench.parse_args(["--sides", "miles", "--seeds", "6", "--trl-rewards", str(STORED)]), "cuda"
    )
    assert [d["seed"] for d in stored] == list(range(6)) and all(len(d["rewards"]) == 30 for d in stored)
    with pytest.raises(SystemExit, match="on cpu"):  # GPU runs are not paired with a CPU call
        bench.load_trl_rewards(bench.parse_args(["--sides", "miles", "--trl-rewards", str(STORED)]), "cpu")
