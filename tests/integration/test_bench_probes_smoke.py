"""bench/sampling_fidelity.py, bench/import_cost.py, bench/fp8.py, bench/packed_rows.py,
bench/engine_throughput.py, bench/residual_stream.py, bench/decode_attention.py, bench/elementwise_kernels.py,
bench/ipc_cycles.py and bench/forward_alignment.py on CPU with a tiny
model: every side samples and scores, every phase is timed.

The rewards of a random tiny model mean nothing; GPU figures: bench/results/e2e_vs_trl.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.bench_modules import load_bench

from e2e_helpers import REPO  # isort: skip


def test_every_side_reports(tmp_path):
    cmd = [sys.executable, "bench/sampling_fidelity.py", "--device", "cpu", "--prompts", "3", "--samples", "2"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["prompts"] == 3 and line["samples"] == 2
    for side in ("engine-bf16", "engine-fp32", "hf-autocast", "hf-bf16", "hf-fp32"):
        assert 0.0 <= line[side]["reward"] <= 1.0 and line[side]["tokens"] > 0, side
    assert "minus_hf_autocast" in line["engine-bf16"] and "minus_hf_autocast" not in line["hf-autocast"]


def test_import_cost_reports_each_phase():
    cmd = [sys.executable, "bench/import_cost.py", "--runs", "1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    median = json.loads(out.stdout.strip().splitlines()[-1])["median"]
    assert median["import_torch"] > 0 and median["import_transformers_model"] > 0
    assert median["from_pretrained_first"] >= 0


def test_fp8_bench_reports_speed_install_and_colocated_push():
    cmd = [sys.executable, "bench/fp8.py", "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
           "--intermediate", "512", "--vocab", "512", "--batch", "4", "--new-tokens", "8", "--reps", "1",
           "--install-reps", "1", "--kv-cache-dtype", "fp8_e4m3"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tok_s", "install_s", "push_s"):
        assert line[f"bf16_{key}"] > 0 and line[f"fp8_{key}"] > 0, key
    assert line["push_ratio"] > 0 and line["install_ratio"] > 0 and line["kv_cache_dtype"] == "fp8_e4m3"
    # the switch is on, but on a CPU no GEMM runs on cuBLASLt, so no norm or SiLU quantizes for one
    assert line["fused_input_quant"] is True and line["fused_input_quant_served"] is False
    for side in ("bf16", "fp8"):  # 7 decode steps of the whole batch, 6 back to back in each of the timed rounds
        assert line["decode_steps"][side]["steps"] == 6 and line["decode_steps"][side]["step_ms"] > 0, side
    steps = line["decode_steps"]
    assert line["decode_step_ratio"] == round(steps["bf16"]["step_ms"] / steps["fp8"]["step_ms"], 3)


def test_engine_throughput_bench_reads_its_decode_steps_from_the_scheduler():
    cmd = [sys.executable, "bench/engine_throughput.py", "--batch", "8", "--prompt-len", "20", "--new-tokens", "12",
           "--reps", "2", "--skip-hf", "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    steps = line["decode_steps"]  # 11 decode steps a round, 10 back to back, in 2 timed rounds
    assert steps["steps"] == 20 and steps["step_ms"] > 0 and steps["host_ms"] + steps["wait_ms"] > 0
    assert line["engine_tok_s"] > 0 and line["prefix_cache"] is True and line["residual_dtype"] == "float32"
    assert line["kv_cache_dtype"] == "auto"
    refused = subprocess.run([*cmd, "--sync-debug"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--sync-debug counts host waits for a CUDA device" in refused.stderr


def test_engine_throughput_bench_times_transformers_generate_with_a_static_cache():
    """The transformers side with `--hf-cache-implementation static` (TRL's cache_implementation='static'): its
    rounds generate the asked length through a static cache, and the line says which cache it timed."""
    cmd = [sys.executable, "bench/engine_throughput.py", "--batch", "4", "--prompt-len", "8", "--new-tokens", "6",
           "--reps", "1", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
           "--vocab", "512", "--threads", "1", "--hf-cache-implementation", "static"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["hf_tok_s"] > 0 and line["hf_cache_implementation"] == "static"


def test_packed_rows_bench_counts_the_padded_layouts_extra_work():
    cmd = [sys.executable, "bench/packed_rows.py", "--samples", "12", "--max-tokens-per-gpu", "2048", "--reps", "1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["padded_tokens"] > line["tokens"] and 0 < line["padding_share"] < 0.5
    assert line["head_rows_over_answers"] > 1 and 0 < line["padded_flops_waste"] < 0.5
    assert line["padded_s"] > 0 and line["packed_s"] > 0
    assert line["micro_batches"]["packed"] <= line["micro_batches"]["padded"]  # no padding in the packed budget
    only = load_bench("packed_rows").main([*cmd[2:], "--count-only"])  # in this process: it builds no model
    assert only["padded_flops_waste"] == line["padded_flops_waste"] and "padded_s" not in only


def test_residual_stream_bench_scores_both_streams_against_fp32():
    cmd = [sys.executable, "bench/residual_stream.py", "--layers", "12", "--hidden", "128", "--intermediate", "256",
           "--batch", "4", "--seq-len", "32"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["tokens"] == 4 * 31 and 0 < line["fp32_stream"]["mean"] < line["bf16_stream"]["mean"]
    assert line["mean_ratio"] > 1.05  # 1.15 at this size; 1.40 and 1.52 at 24 layers x 256 (seeds 0, 1)


def test_decode_attention_sweep_checks_every_setting_against_the_default():
    """Under Triton's interpreter: every setting runs, its output is the default's (to summation order), the
    key splits change with the settings, and the summary names the default and the best."""
    pytest.importorskip("triton")
    cmd = [sys.executable, "bench/decode_attention.py", "--device", "cpu", "--batch", "4", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--context", "40", "--capacity", "128", "--layers", "2",
           "--num-warps", "4", "--num-stages", "2", "--block-n", "16,32", "--programs-per-sm", "1,4",
           "--blocks-per-split", "1"]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    settings, summary = lines[:-1], lines[-1]
    assert len(settings) == 5 and not summary["refused"]  # the default, then the four of the grid
    assert {s["splits"] for s in settings} > {1}  # more programs per SM split the keys
    assert all(s["max_diff"] < 1e-5 for s in settings)  # fp32 on CPU: the same attention
    assert summary["default"]["block_n"] == 64 and summary["best"]["us"] <= summary["default"]["us"]
    assert summary["timed_on_cpu"] is True


def test_forward_alignment_bench_finds_the_aligned_trainer_exact_on_cpu(tmp_path):
    env = {**os.environ, "MILES_CACHE": str(tmp_path / "cache"), "MILES_TORCH_THREADS": "1"}
    cmd = [sys.executable, "bench/forward_alignment.py", "--device", "cpu", "--specs", "tiny:qwen2:2x128"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])["tiny:qwen2:2x128"]
    forms = line["forms"]
    assert forms["fp8+stream"]["vs_fp8_mean"] == 0.0 < forms["plain"]["vs_fp8_mean"]  # bit for bit on CPU
    assert forms["stream"]["vs_bf16_mean"] == 0.0
    assert line["layer0"] == {"weights_max_diff": 0.0, "product_max_diff": 0.0, "product_mean_diff": 0.0}


@pytest.mark.parametrize("triton_input", ["inside", "prequant"])
def test_fp8_gemm_bench_checks_every_setting_against_the_dequantized_product(triton_input):
    """Under Triton's interpreter: each GEMM of a small layer runs at the default and every swept setting (K
    whole and in two chunks; the activation quantized inside the GEMM or by its own kernel first), each equal
    to the fp32 product of the same codes, and the summary adds up the layer (no cuBLASLt on CPU)."""
    pytest.importorskip("triton")
    cmd = [sys.executable, "bench/fp8_gemm.py", "--device", "cpu", "--batch", "8", "--hidden", "256",
           "--intermediate", "384", "--heads", "2", "--kv-heads", "1", "--head-dim", "128", "--block-m", "16",
           "--block-n", "64,128", "--num-warps", "4", "--num-stages", "2", "--reps", "1", "--triton-splits", "1,2",
           "--triton-input", triton_input]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    gemms, summary = lines[:-1], lines[-1]
    assert [g["gemm"] for g in gemms] == ["qkv", "o", "gate_up", "down"]
    assert [(g["n"], g["k"]) for g in gemms] == [(512, 256), (256, 256), (768, 256), (256, 384)]
    assert summary["refused"] == 0 and summary["worst_rel_diff"] < 1e-5
    assert summary["layer_us"]["cublas"] is None and summary["triton_best_over_cublas"] is None
    assert set(summary["best_settings"]) == {"qkv", "o", "gate_up", "down"} and summary["timed_on_cpu"] is True
    assert summary["triton_input"] == triton_input and summary["refused"] == 0
    swept = [s["settings"] for g in gemms for s in [g["triton_default"], g["triton_best"]]]
    assert all(len(s) == 5 for s in swept) and gemms[0]["triton_default"]["settings"][4] == 1
    # the default, then 2 column widths x 2 K chunkings, each timed and checked
    assert all(len(g["triton_sweep"]) == 5 and g["triton_worst_rel_diff"] < 1e-5 for g in gemms)


def test_ipc_cycles_runs_the_release_cycle_across_two_processes():
    """On CPU the buffer is a shared-memory segment (no CUDA count): the cycle itself, written and read back."""
    for mapping in ("close", "keep"):
        cmd = [
            sys.executable,
            "bench/ipc_cycles.py",
            "--device",
            "cpu",
            "--mib",
            "4",
            "--cycles",
            "3",
            "--mapping",
            mapping,
        ]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        line = json.loads(out.stdout.strip().splitlines()[-1])
        assert [c["cycle"] for c in line["cycles"]] == [0, 1, 2] and all(c["written"] for c in line["cycles"])
        assert line["growth_in_buffers_per_cycle"] is None  # no device memory to read on CPU


def test_elementwise_kernels_sweep_checks_every_setting_against_the_default():
    """Under Triton's interpreter: the norm's and SiLU's settings all run, quantizing or not, each output equal to
    the default setting's (the norm adds into its residual: every setting scores the same fresh inputs)."""
    pytest.importorskip("triton")
    cmd = [sys.executable, "bench/elementwise_kernels.py", "--device", "cpu", "--batch", "3", "--hidden", "256",
           "--intermediate", "384", "--layers", "2", "--replays", "1", "--norm-warps", "2,4",
           "--silu-block", "128,1024", "--silu-warps", "4"]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    settings, summary = lines[:-1], lines[-1]
    assert len(settings) == 2 * (2 + 2)  # quantized and not: the norm's two, SiLU's default and block 128
    assert all(s["max_diff"] == 0.0 for s in settings)
    for kernel in ("norm_quantized", "silu_quantized", "norm_model_dtype", "silu_model_dtype"):
        assert not summary[kernel]["refused"] and summary[kernel]["best"]["us"] <= summary[kernel]["default"]["us"]
    assert (
        summary["norm_quantized"]["default"]["num_warps"] == 4
        and summary["silu_quantized"]["default"]["block"] == 1024
    )


def test_engine_throughput_warm_up_builds_the_extend_path_then_empties_the_cache(tmp_path):
    # the extend path's kernels are built by a round whose prompts hit the cache; the timed rounds must then start
    # from an empty cache, not from one a one-token round filled (which made them evict and replace pages)
    bench = load_bench("engine_throughput")
    args = bench.parse_args(
        ["--device", "cpu", "--batch", "4", "--prompt-len", "40", "--new-tokens", "4", "--skip-hf"]
    )
    _, engine = bench.build_engine(args, str(tmp_path), "float32")
    side = bench.EngineSide(engine, bench.make_prompts(args.batch, args.prompt_len, engine.model.spec.vocab_size))
    try:
        side.warm_extend()
        stats = engine.prefix_cache_stats()
    finally:
        side.close()
    assert stats["prefill_tokens_requested"] == 2 * 4 * 40
    assert stats["prefill_tokens_computed"] < stats["prefill_tokens_requested"]  # the second round hit the first's
    assert stats["cached_pages"] == 0


def test_engine_throughput_times_its_rounds_once_the_prefix_cache_has_settled(tmp_path):
    # 64 prompts of 64 tokens over a pool that holds fewer of their pages: from an empty pool the rounds evict and
    # replace pages for a few rounds; the timed rounds must start once a round evicts nothing
    bench = load_bench("engine_throughput")
    argv = ["--device", "cpu", "--batch", "64", "--prompt-len", "64", "--new-tokens", "8", "--skip-hf"]
    args = bench.parse_args([*argv, "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"])
    _, engine = bench.build_engine(args, str(tmp_path), "float32")
    side = bench.EngineSide(engine, bench.make_prompts(args.batch, args.prompt_len, engine.model.spec.vocab_size))
    try:
        side.warm_extend()
        side.round(args.new_tokens)
        assert side.evicted() > 0  # the case settling is for
        rounds = side.settle_cache(args.new_tokens)
        before = side.evicted()
        side.round(args.new_tokens)
    finally:
        side.close()
    assert rounds < bench.SETTLE_ROUNDS and side.evicted() == before  # settled before the cap
