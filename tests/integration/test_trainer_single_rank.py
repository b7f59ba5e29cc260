"""The FSDP backend on one CPU rank, where the model stays a plain module (no fully_shard).

With one rank and no mixed precision FSDP would only copy parameters and gradients, so the
backend skips it; every property the 2-rank tests check must hold on this path too: loss,
gradients and log-probs equal the single-process reference (same tolerance), offload -> onload
is bit-exact and releases the storages, save -> fresh process -> load gives a bit-identical next
step, and a 1-rank checkpoint loads into 2 FSDP ranks (equal up to summation order: 1e-5).
"""

from __future__ import annotations

import pytest
import test_checkpoint as ckpt_test
import test_fsdp_trainer as ref_test
import test_offload as offload_test
import torch

from _trainer_harness import make_batch, make_tiny_model, run_ranks  # isort: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("model") / "model"))


def test_loss_gradients_and_log_probs_match_single_process(model_dir, tmp_path):
    run_ranks(ref_test._rank_fn, 1, model_dir, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    ref = ref_test._reference(model_dir, make_batch(ref_test.NUM_SAMPLES, seed=1))
    for variant in ref_test.VARIANTS:
        assert got[variant]["metrics"]["train/loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=1e-4)
        assert set(got[variant]["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got[variant]["grads"][name], g, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(got[variant]["log_probs"], ref["log_probs"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[variant]["entropy"], ref["entropy"], atol=1e-5, rtol=1e-5)


def test_offload_round_trip_is_bit_exact(model_dir, tmp_path):
    run_ranks(offload_test._rank_fn, 1, model_dir, str(tmp_path))
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r["released"] and r["ref_same"]
    assert any(k.endswith("exp_avg_sq") for k in r["before"])
    assert set(r["before"]) == set(r["after"])
    for k, v in r["before"].items():
        assert torch.equal(r["after"][k], v), k
    assert r["metrics"][0]["train/loss"] == r["metrics"][1]["train/loss"]
    for name, bits in r["next"][1].items():
        assert torch.equal(r["next"][0][name], bits), name


def test_checkpoint_resume_on_one_rank_and_on_two(model_dir, tmp_path):
    run_ranks(ckpt_test._run_a, 1, model_dir, str(tmp_path))
    run_ranks(ckpt_test._run_b, 1, model_dir, str(tmp_path))
    a, b = (torch.load(tmp_path / f"{x}0.pt", weights_only=False) for x in "ab")
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/entropy"):
        assert b["metrics"][key] == a["metrics"][key], key
    for name, p in a["params"].items():
        assert torch.equal(b["params"][name], p), name

    run_ranks(ckpt_test._run_b, 2, model_dir, str(tmp_path))  # the 1-rank checkpoint into 2 FSDP ranks
    b2 = torch.load(tmp_path / "b0.pt", weights_only=False)
    assert b2["metrics"]["train/loss"] == pytest.approx(a["metrics"]["train/loss"], abs=1e-5)
    for name, p in a["params"].items():
        torch.testing.assert_close(b2["params"][name], p, atol=1e-5, rtol=1e-4, msg=name)
