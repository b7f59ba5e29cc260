#!/usr/bin/env bash
# The GPU re-checks of the embedded engine's kernels, FP8 serving, the FP8 KV cache and the MoE path, in
# groups that each fit a 10-minute call on one H100 / H200. CI cannot see CUDA: after a change to the
# engine's kernels, forwards, scheduler or weight paths, run `kernels` (and `trainer` after one to the trainers
# or the colocated hand-over) before anything is called verified, then the figure groups whose results files
# the change touches.
#
#   bash bench/gpu_checks.sh kernels            # the GPU-marked and interpreter-capable kernel tests on CUDA
#   bash bench/gpu_checks.sh trainer            # the trainers' and the colocated weight path's GPU tests (FSDP,
#                                               #   megatron when megatron-core is installed, offload, async saves;
#                                               #   over 8 minutes on an H200: a call of its own)
#   bash bench/gpu_checks.sh stream             # compiled colocated runs, two each: the fp32 residual stream and
#                                               #   LoRA's merged forward against the plain ones (about 5 minutes)
#   bash bench/gpu_checks.sh contract           # the same with FP8 rollouts: the trainer's FP8 forward contract,
#                                               #   the engine dequantizing and with its CUDA kernels (5.1 min, H100)
#   bash bench/gpu_checks.sh forms              # cuBLASLt's block-scaled forms (MILES_FP8_GEMM_FORM: block, rows,
#                                               #   swapped) on a 7B layer's GEMMs, then FP8 / BF16 tokens/s on the
#                                               #   7B shape through block and each form faster than it (2-6 minutes)
#   bash bench/gpu_checks.sh fp8                # a 7B layer's FP8 GEMMs: cuBLASLt's whole and split-K,
#                                               #   Triton's with the activation quantized inside, then by its kernel
#                                               #   first (K whole and in 2 and 4 chunks); then FP8 / BF16 tokens/s
#                                               #   on the 7B shape (each run against BF16 in itself): split-K GEMMs
#                                               #   and an FP8 KV cache, split-K alone, whole GEMMs, then the
#                                               #   separate quantization kernel
#   bash bench/gpu_checks.sh kv                 # the 0.5B shape at batch 256: bf16 KV against fp8_e4m3 KV, and
#                                               #   without prefix sharing (its hits through the fused extend);
#                                               #   then the decode attention's launch settings at the 7B shape
#   bash bench/gpu_checks.sh lt_workspace       # a 7B layer's FP8 GEMMs with cuBLASLt's workspace at torch's default
#                                               #   (1 MiB) and at the engine's (32 MiB), then FP8 / BF16 tokens/s
#                                               #   with torch's
#   bash bench/gpu_checks.sh elementwise        # the norm and SiLU kernels' launch settings (quantizing and not) at
#                                               #   the 7B and the 0.5B shapes, batch 256 (under a minute)
#   bash bench/gpu_checks.sh moe                # R3's gap at real proportions with the bf16 trainer's fp32 stream,
#                                               #   split into the engine's decode against its own prefill and
#                                               #   the trainer against that prefill (--engine-rescore), then
#                                               #   where in one forward the two first differ (stream_diff.py)
#   bash bench/gpu_checks.sh offload_memory     # the direct weight path's release cycle across two processes at
#                                               #   1 GiB (bench/ipc_cycles.py), then a colocated run with offload on
#                                               #   (the engine releases its weights and KV every step) at 12 x 2048
#                                               #   (1.2 GB of bf16 weights): each process's device memory step by
#                                               #   step against the push's bytes
#   bash bench/gpu_checks.sh all                # every group above, one after the other (over half an hour)
#
# Each figure group prints the bench's lines and its closing JSON line; the results files that read them:
# bench/results/fp8.md, engine_throughput.md, moe.md. Logs go to ${OUT:-runs/gpu_checks}/<group>.log too.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_checks}"
mkdir -p "$out"

kernels() {
    python -m pytest -q tests/unit/test_triton_ops.py tests/unit/test_triton_fp8_input.py \
        tests/unit/test_triton_kv_fp8.py tests/unit/test_moe_triton.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_fp8_gpu.py tests/gpu/test_kv_fp8_gpu.py tests/gpu/test_moe_gpu.py \
        tests/gpu/test_prefix_cache_gpu.py tests/gpu/test_engine_weight_cycles_gpu.py
}

trainer() {
    python -m pytest -q tests/gpu/test_fsdp_gpu.py tests/gpu/test_colocated_gpu.py tests/gpu/test_memory_levers_gpu.py \
        tests/gpu/test_varlen_attention_gpu.py tests/gpu/test_megatron_gpu.py tests/gpu/test_megatron_moe_gpu.py
}

# each test trains twice, compiled: two files' worth of runs would not fit one call beside the trainer group
stream() {
    python -m pytest -q -s tests/gpu/test_fp32_residual_gpu.py -k "not fp8_rollouts"
}

contract() {
    python -m pytest -q -s tests/gpu/test_fp32_residual_gpu.py -k fp8_rollouts
}

fp8() {
    local shape=(--device cuda --batch 256 --prompt-len 128 --new-tokens 512 --reps 2 --install-reps 3)
    python bench/fp8_gemm.py --device cuda --block-m 64 --block-n 128 --num-warps 4 --num-stages 3
    python bench/fp8_gemm.py --device cuda --block-m 64 --block-n 128 --num-warps 4 --num-stages 3 --triton-input prequant --triton-splits 1,2,4
    # the FP8 CUDA kernels are on by default (MILES_FP8_CUDA_KERNELS=0 would dequantize)
    MILES_FP8_SPLIT_K=auto python bench/fp8.py "${shape[@]}" --kv-cache-dtype fp8_e4m3
    MILES_FP8_SPLIT_K=auto python bench/fp8.py "${shape[@]}"
    python bench/fp8.py "${shape[@]}"
    python bench/fp8.py "${shape[@]}" --separate-input-quant
}

# cuBLASLt's block-scaled forms (fp8_forms.py): each timed on a 7B layer's GEMMs, then the engine serving through
# each form whose GEMMs beat the block form's by 3% over the layer (FP8 KV, against BF16 in the same run; on an
# H100 neither did, so a slower form costs no end-to-end run), the engine's default form last
forms() {
    local shape=(--device cuda --batch 256 --prompt-len 128 --new-tokens 512 --reps 2 --install-reps 1
        --kv-cache-dtype fp8_e4m3)
    local gemms="$out/forms_gemm.jsonl"
    python bench/fp8_gemm.py --device cuda --block-m 64 --block-n 128 --num-warps 4 --num-stages 3 --scale-layouts > "$gemms"
    cat "$gemms"
    local faster
    faster=$(python -c '
import json, sys
us = json.loads(open(sys.argv[1]).read().splitlines()[-1]).get("layouts_us", {})
print(" ".join(f for f, t in sorted(us.items(), key=lambda kv: kv[1]) if f != "block" and t < 0.97 * us.get("block", 0)))
' "$gemms")
    echo "forms faster than block over the layer: ${faster:-none}"
    for form in $faster; do
        MILES_FP8_GEMM_FORM=$form python bench/fp8.py "${shape[@]}"
    done
    python bench/fp8.py "${shape[@]}"
}

kv() {
    local shape=(--device cuda --batch 256 --prompt-len 128 --new-tokens 256 --hidden 896 --layers 24 --heads 14
        --kv-heads 2 --intermediate 4864 --vocab 151936 --skip-hf --reps 3)
    python bench/engine_throughput.py "${shape[@]}"
    python bench/engine_throughput.py "${shape[@]}" --kv-cache-dtype fp8_e4m3
    python bench/engine_throughput.py "${shape[@]}" --no-prefix-cache
    python bench/decode_attention.py --device cuda --heads 28 --kv-heads 4 --head-dim 128 --context 384
}

# cuBLASLt's workspace: torch gives cuBLASLt, the block-scaled FP8 GEMMs' library, CUBLASLT_WORKSPACE_SIZE KiB; unset,
# 1,024 in one version of its source read (CublasHandlePool.cpp), 32,768 on Hopper in another: which one torch 2.11
# takes is what this group finds out. A split-K algorithm needs workspace, and the FP8 GEMMs with few output tiles
# (qkv, o, down at batch 256) run none.
# The layer's GEMMs with torch's default and with 32 MiB, then FP8 / BF16 tokens/s on the 7B shape with 32 MiB
# (both sides). Not yet run.
lt_workspace() {
    local shape=(--device cuda --batch 256 --prompt-len 128 --new-tokens 512 --reps 2 --install-reps 1
        --kv-cache-dtype fp8_e4m3)
    # the engine sets 32 MiB unless CUBLASLT_WORKSPACE_SIZE is set (fp8.CUBLASLT_WORKSPACE_KIB); 1024 is torch's own
    CUBLASLT_WORKSPACE_SIZE=1024 python bench/fp8_gemm.py --device cuda --block-m 64 --block-n 128 --num-warps 4 --num-stages 3
    python bench/fp8_gemm.py --device cuda --block-m 64 --block-n 128 --num-warps 4 --num-stages 3
    CUBLASLT_WORKSPACE_SIZE=1024 python bench/fp8.py "${shape[@]}"
}

elementwise() {
    python bench/elementwise_kernels.py --device cuda
    python bench/elementwise_kernels.py --device cuda --hidden 896 --intermediate 4864 --layers 24
}

moe() {
    local shape=(--layers 24 --hidden 2048 --heads 32 --kv-heads 4 --experts 128 --topk 8 --moe-intermediate 768
        --batch 256 --context 512 --reps 3 --new-tokens 32 --skip-decode --train-micro-batch 32
        --trainer-dtype bfloat16 --trainer-residual-dtype float32)
    # what R3 leaves, split: the engine's decode against its own prefill of the same sequences, and the trainer
    # against that prefill (cuBLAS's split-K sums in fp32 changed no digit here: bench/results/moe.md)
    python bench/moe.py "${shape[@]}" --engine-moe-rounding transformers --engine-rescore
    # where, inside one teacher-forced forward, the trainer first leaves the engine's prefill (routing replayed)
    python bench/stream_diff.py --device cuda --trainer-residual-dtype float32 --replay --engine-moe-rounding transformers
}

# an 0.5B colocated run with offload on an H100 grew the engine's process by one weight push a step (1.17 GiB) until
# the trainer ran out of memory at step 15; tiny models (KB of weights) cannot show such a leak, this size can
offload_memory() {
    # the release cycle alone, two processes, 1 GiB: one share's count for each mapping (the engine's way), then the
    # count dropped at once after sharing (its way before, which an offloading 0.5B run showed growing)
    python bench/ipc_cycles.py --device cuda --mib 1024 --cycles 6
    python bench/ipc_cycles.py --device cuda --mib 1024 --cycles 6 --drop-count
    # 12 layers of hidden 2048 (16 heads of 128, 2 KV heads), 1.2 GB of bf16 weights, drawn on the GPU; the demo
    # recipe with a learning rate for a model of that size
    miles tiny-model "$out/offload_model" --layers 12 --hidden 2048 --heads 16 --kv-heads 2 --intermediate 5504 \
        --vocab 32768 --device cuda
    miles train --config launch/configs/demo_cpu.yaml --hf-checkpoint "$out/offload_model" --colocate \
        --offload-train --offload-rollout --num-rollout 8 --eval-interval 100 --output-dir "$out/offload_memory" \
        --lr 1e-6 --no-progress-bar
    python bench/memory_by_step.py "$out/offload_memory"
}

run_group() {
    echo "== $1 ($(date -u +%H:%M:%S))"
    "$1" 2>&1 | tee "$out/$1.log"
    return "${PIPESTATUS[0]}"
}

case "${1:-}" in
    kernels | trainer | stream | contract | forms | fp8 | kv | lt_workspace | elementwise | moe | offload_memory) run_group "$1" ;;
    all)
        status=0
        for group in kernels trainer stream contract forms fp8 kv lt_workspace elementwise moe offload_memory; do run_group "$group" || status=1; done
        exit "$status"
        ;;
    *)
        echo "usage: bash bench/gpu_checks.sh kernels|trainer|stream|contract|forms|fp8|kv|lt_workspace|elementwise|moe|offload_memory|all (see the comment at the top)" >&2
        exit 2
        ;;
esac
