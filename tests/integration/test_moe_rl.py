"""MoE RL end to end on CPU: a short GRPO run on a tiny qwen3_moe whose weight pushes pass the equality check,
with R3 on; R3's effect measured by bench/moe.py's mismatch (bf16 engine, fp32 trainer, noisy trainer router)
and located by its --engine-rescore split and bench/stream_diff.py; the flag refused for a dense model at
start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from e2e_helpers import leftover_processes, run_train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from bench_modules import load_bench  # noqa: E402

SHORT = (
    "--hf-checkpoint", "tiny:qwen3_moe:2x64", "--num-rollout", "2", "--rollout-batch-size", "4",
    "--global-batch-size", "32", "--eval-interval", "0", "--sglang-dtype", "bfloat16",
)  # fmt: skip


def test_grpo_on_qwen3_moe_with_r3_pushes_exact_weights_and_replays_the_engines_routing(tmp_path):
    out = tmp_path / "run"
    rows = run_train(out, *SHORT, "--check-weight-update-equal", "--use-rollout-routing-replay")
    assert not leftover_processes(str(out))
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["train/routing_mismatch"] == 0.0  # the forward used exactly the engine's experts
        assert 0.0 <= r["train/router_rollout_mismatch"] < 0.2
    log = (out / "logs" / "trainer_0.log").read_text()
    assert "weight update check passed" in log


def test_r3_zeroes_the_routing_mismatch_and_lowers_the_logprob_gap():
    bench = load_bench("moe")
    args = bench.parse(
        "--device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 --experts 8 --topk 2 --moe-intermediate 32 "
        "--vocab 512 --batch 8 --prompt-len 16 --new-tokens 16 --router-noise 0.05 --skip-decode --train-micro-batch 3".split()
    )
    m = bench.run(args)["mismatch"]
    off, on = m["off"], m["on"]
    assert off["routing_mismatch"] > 0.0 and on["routing_mismatch"] == 0.0
    assert on["router_rollout_mismatch"] > 0.0  # the trainer's own router still disagrees: R3 overrides it
    assert on["logprob_abs_diff_mean"] < off["logprob_abs_diff_mean"]
    assert on["logprob_abs_diff_max"] < off["logprob_abs_diff_max"]


def test_an_fp32_residual_stream_narrows_what_r3_leaves_of_a_bf16_engines_gap():
    """12 MoE layers, bf16 engine, fp32 trainer, routing replayed: with the engine's residual stream in fp32
    (its default) the log-probs sit closer to the trainer's than with the stream in bf16 (measured 1.9x at
    24 layers, bench/results/moe.md)."""
    bench = load_bench("moe")
    base = (
        "--device cpu --layers 12 --hidden 128 --heads 4 --kv-heads 2 --experts 16 --topk 4 --moe-intermediate 64 "
        "--vocab 1024 --batch 8 --prompt-len 16 --new-tokens 12 --skip-decode --train-micro-batch 8"
    ).split()
    gaps = {
        stream: bench.run(bench.parse([*base, "--residual-dtype", stream]))["mismatch"]["on"]["logprob_abs_diff_mean"]
        for stream in ("float32", "model")
    }
    assert gaps["float32"] < 0.8 * gaps["model"], gaps


def test_what_r3_leaves_on_cpu_is_the_engines_decode_against_its_own_prefill():
    """A bf16 trainer with the fp32 stream scores the sampled sequences exactly as the engine's own prefill of them
    does, so its whole gap to the rollout, R3 off, is the engine's decode against that prefill (attention's sums
    depend on how many tokens a call holds): `--engine-rescore`'s split (bench/results/moe.md)."""
    bench = load_bench("moe")
    args = bench.parse(
        "--device cpu --layers 6 --hidden 128 --heads 4 --kv-heads 2 --experts 16 --topk 4 --moe-intermediate 64 "
        "--vocab 1024 --batch 8 --prompt-len 16 --new-tokens 16 --train-micro-batch 8 --skip-decode "
        "--trainer-dtype bfloat16 --trainer-residual-dtype float32 --engine-rescore".split()
    )
    figures = bench.run(args)
    for mode in ("off", "on"):
        vs_prefill = figures["mismatch_vs_engine_prefill"][mode]
        assert vs_prefill["routing_mismatch"] == 0.0 and vs_prefill["logprob_abs_diff_max"] == 0.0, mode
    engine_self, off = figures["engine_decode_vs_prefill"], figures["mismatch"]["off"]
    assert engine_self["logprob_abs_diff_mean"] > 0.0
    assert engine_self["logprob_abs_diff_mean"] == pytest.approx(off["logprob_abs_diff_mean"], rel=1e-6)
    assert engine_self["routing_mismatch"] == pytest.approx(off["routing_mismatch"])


def test_the_benchs_split_k_sums_are_refused_off_cuda():
    """--gemm-split-reduction fp32 changes cuBLAS's sums only: off CUDA it would change nothing, so it stops."""
    bench = load_bench("moe")
    args = bench.parse(
        "--device cpu --layers 2 --hidden 64 --experts 8 --skip-decode --gemm-split-reduction fp32".split()
    )
    with pytest.raises(SystemExit, match="--gemm-split-reduction fp32: cuBLAS's split-K sums only, none on cpu"):
        bench.run(args)


def test_the_stream_diff_finds_no_difference_in_the_aligned_trainer_and_the_first_one_otherwise():
    """bench/stream_diff.py reads the residual stream at every norm on both sides: the bf16 trainer with the fp32
    stream equals the engine's prefill at every point; with transformers' bf16 stream the first difference is the
    first residual add, after layer 0's attention."""
    bench = load_bench("stream_diff")
    base = (
        "--device cpu --layers 4 --hidden 128 --heads 4 --kv-heads 2 --experts 16 --topk 4 --moe-intermediate 64 "
        "--vocab 1024 --batch 4 --seq-len 32 --trainer-dtype bfloat16"
    ).split()
    aligned = bench.run(bench.parse([*base, "--trainer-residual-dtype", "float32"]))
    assert len(aligned["points"]) == 2 * 4 + 1
    assert aligned["first_difference"] is None and aligned["logprob_abs_diff_max"] == 0.0
    assert aligned["routing_mismatch"] == 0.0
    bf16_stream = bench.run(bench.parse([*base, "--trainer-residual-dtype", "model", "--replay"]))
    assert bf16_stream["first_difference"] == "layer 0 after attention"
    assert bf16_stream["routing_mismatch"] == 0.0 and bf16_stream["logprob_abs_diff_mean"] > 0.0


def test_the_benchs_rescore_is_refused_without_the_mismatch():
    bench = load_bench("moe")
    args = bench.parse("--device cpu --layers 2 --hidden 64 --experts 8 --engine-rescore --skip-mismatch".split())
    with pytest.raises(SystemExit, match="--engine-rescore splits the mismatch that --skip-mismatch skips"):
        bench.run(args)


def test_routing_replay_is_refused_for_a_dense_model(tmp_path):
    with pytest.raises(AssertionError) as e:
        run_train(tmp_path / "run", "--num-rollout", "1", "--use-rollout-routing-replay", "--eval-interval", "0")
    assert "--use-rollout-routing-replay" in str(e.value) and "dense" in str(e.value)
