"""--fp32-residual-connection and --fp8-format end to end on CPU, bf16 trainer and engine: the FSDP trainer's
log-probs of the sampled tokens follow the engine's (whose residual stream is fp32) to float precision, where its
own bf16 stream leaves a gap; on a tiny qwen3_moe with R3, beside FP8 rollouts with the quantized forward, and
with LoRA computed on the engine's merged weight (--lora-merged-forward)."""

from __future__ import annotations

import importlib.util

import pytest
from e2e_helpers import run_train

BF16 = (
    "--num-rollout", "2", "--rollout-batch-size", "4", "--global-batch-size", "32", "--eval-interval", "0",
    "--dtype", "bfloat16",
)  # fmt: skip


def _gaps(rows: list[dict]) -> list[float]:
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert len(gaps) == 2
    return gaps


def test_the_trainer_scores_as_the_bf16_engine_samples(tmp_path):
    plain = _gaps(run_train(tmp_path / "plain", *BF16))
    matched = _gaps(run_train(tmp_path / "fp32", *BF16, "--fp32-residual-connection"))
    assert min(plain) > 1e-4, plain  # a bf16 stream rounds where the engine's does not
    assert max(matched) < 1e-5, (matched, plain)


def test_a_moe_policy_with_r3_scores_as_the_engine_samples(tmp_path):
    rows = run_train(
        tmp_path / "moe",
        *BF16,
        "--hf-checkpoint",
        "tiny:qwen3_moe:2x64",
        "--use-rollout-routing-replay",
        "--fp32-residual-connection",
    )
    assert max(_gaps(rows)) < 1e-5
    assert all(r["train/routing_mismatch"] == 0.0 for r in rows if "train/routing_mismatch" in r)


def test_with_fp8_rollouts_the_quantized_forward_scores_as_the_engine_samples(tmp_path):
    fp8 = (*BF16, "--hf-checkpoint", "tiny:qwen2:4x256", "--sglang-quantization", "fp8")
    plain = _gaps(run_train(tmp_path / "bf16", *fp8))
    matched = _gaps(run_train(tmp_path / "fp8", *fp8, "--fp8-format", "e4m3", "--fp32-residual-connection"))
    assert min(plain) > 1e-3, plain  # a bf16 trainer against FP8 samples
    assert max(matched) < 1e-5, (matched, plain)


def test_compiled_blocks_keep_the_engines_roundings(tmp_path):
    """--compile fuses casts away unless told not to: the trainer then emulates them (inductor's
    emulate_precision_casts), so compiled blocks stay with the engine too (1.3e-3 without it on CPU)."""
    flags = (*BF16, "--hf-checkpoint", "tiny:qwen2:4x256", "--sglang-quantization", "fp8", "--compile")
    gaps = _gaps(run_train(tmp_path / "compiled", *flags, "--fp8-format", "e4m3", "--fp32-residual-connection"))
    assert max(gaps) < 2e-4, gaps


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the lora extra)")
def test_lora_with_the_merged_forward_scores_as_the_engine_samples(tmp_path):
    """The engine serves W0 + s B A merged in fp32; peft's W0 x + s B A x rounds otherwise once B moves."""
    lora = (*BF16, "--lora-rank", "4", "--lora-alpha", "16", "--lr", "0.02", "--fp32-residual-connection")
    plain = _gaps(run_train(tmp_path / "unmerged", *lora))
    merged = _gaps(run_train(tmp_path / "merged", *lora, "--lora-merged-forward"))
    assert plain[1] > 1e-4, plain  # step 0 agrees (B = 0); after the first update the forms part
    assert max(merged) < 1e-5, (merged, plain)
