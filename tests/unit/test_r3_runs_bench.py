"""bench/r3_runs.py: the side-by-side summary of an R3-off and an R3-on run."""

import json

from bench_modules import load_bench

r3_runs = load_bench("r3_runs")


def _write(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_means_over_all_and_the_last_steps_and_a_missing_metric_stays_missing(tmp_path, capsys):
    off = [{"train/train_rollout_logprob_abs_diff": float(i), "rollout/reward_mean": 0.1} for i in range(12)]
    on = [{"train/train_rollout_logprob_abs_diff": 0.5, "train/routing_mismatch": 0.0, "rollout/reward_mean": 0.2}] * 3
    on = [*on, {"eval/digit_copy/reward_mean": 0.7}]
    _write(tmp_path / "off", off)
    _write(tmp_path / "on", on)
    r3_runs.main([str(tmp_path / "off"), str(tmp_path / "on")])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["off"]["logprob_abs_diff"] == 5.5  # mean of 0..11
    assert figures["off"]["logprob_abs_diff_last10"] == 6.5  # mean of 2..11
    assert figures["off"]["routing_mismatch"] is None  # never measured with replay off
    assert figures["on"]["routing_mismatch"] == 0.0 and abs(figures["on"]["reward"] - 0.2) < 1e-12
    assert figures["on"]["eval_reward_last"] == 0.7 and figures["off"]["eval_reward_last"] is None
