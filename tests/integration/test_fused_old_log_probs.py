"""One optimizer step a rollout: the old log-probs come from the update's own forward.

The step's loss, metrics and gradients equal those of the same step with the separate
old-log-prob pass (fp32 on CPU: only summation order may differ), and the separate pass is not run.
"""

from __future__ import annotations

import os

import torch

from _trainer_harness import capture_grads_at_step, configs, make_batch, make_tiny_model, run_ranks  # isort: skip

NUM_SAMPLES = 8
ALGO = dict(advantage_estimator="grpo")


def _step(model_dir: str, fused: bool) -> dict:
    import miles.trainer.train_loop as train_loop
    from miles.trainer.backend import create_backend

    be = create_backend("fsdp", **configs(model_dir, algo=ALGO, rollout={"global_batch_size": NUM_SAMPLES}))
    be.setup()
    calls = []
    real = be.compute_log_probs
    be.compute_log_probs = lambda *a, **k: calls.append(a) or real(*a, **k)
    if not fused:
        train_loop.old_log_probs_in_update = lambda *a: False
    captured = capture_grads_at_step(be)
    metrics = be.train(make_batch(NUM_SAMPLES, seed=3), rollout_id=0)
    return {"metrics": metrics, "grads": captured, "separate_passes": len(calls)}


def _rank_fn(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    results = {"fused": _step(model_dir, True), "separate": _step(model_dir, False)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_fused_old_log_probs_match_the_separate_pass(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "model"))
    run_ranks(_rank_fn, 1, model_dir, str(tmp_path))
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    fused, separate = r["fused"], r["separate"]
    assert (fused["separate_passes"], separate["separate_passes"]) == (0, 1)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/ppo_kl"):
        assert abs(fused["metrics"][key] - separate["metrics"][key]) <= 1e-5 + 1e-4 * abs(separate["metrics"][key]), (
            key
        )
    assert fused["metrics"]["train/pg_clipfrac"] == 0.0
    for name, g in separate["grads"].items():
        torch.testing.assert_close(fused["grads"][name], g, rtol=1e-4, atol=1e-5)
