"""FP8 serving against BF16, same random model, same call: generated tokens/s and the weight install.

Two embedded engines on one GPU serve one random bf16 checkpoint (default: the 7B shape of
Qwen2.5-7B), one as it is and one in FP8 (`quantization="fp8"`: e4m3 weights with 128x128 block
scales, W8A8 GEMMs, fp8.py). After a warm-up each, their generation rounds (batch x new tokens,
temperature 1, eos ignored, prefill included) alternate for --reps repetitions; medians are compared.

Weight install: the same bf16 tensors (the model's own, already on the GPU, in buckets of
--bucket-mb) are loaded into each engine with `load_weights`, as a push's receiver does after the
transport: a copy into the bf16 engine, a per-block quantization on the GPU for the FP8 one. The
transport itself (NCCL broadcast, the same bytes for both) is not part of this figure.

Colocated push: the whole weight push of a colocated run (the direct path, miles/weights/colocated_direct.py)
into each engine: the trainer-side writes into the engine's exported weight buffer (a device copy for bf16;
for FP8, the per-block quantization of each tensor and the write of its values and scales) and the install
call, between two device synchronisations. In a run the trainer maps the buffer from another process through
CUDA IPC and calls install over HTTP (about a millisecond, the same for both); here both sides share one
process, so the writer works on the engine's own buffer.

GPU:  python bench/fp8.py --device cuda --batch 256 --prompt-len 128 --new-tokens 512
CPU smoke: python bench/fp8.py --hidden 256 --layers 2 --heads 4 --kv-heads 2 --intermediate 512 \\
          --vocab 512 --batch 4 --new-tokens 8 --reps 1
--kv-cache-dtype (SGLang's values; default auto) sets the FP8 side's KV cache: fp8_e4m3 times FP8 weights
with an FP8 cache against BF16 with a bf16 one.
On Hopper (MILES_FP8_CUDA_KERNELS on, the default) the FP8 side runs cuBLASLt's block-scaled GEMMs, whose inputs from the
norms and SiLU come quantized by those kernels (fp8.FUSED_INPUT_QUANT); --separate-input-quant quantizes every
GEMM input in its own kernel instead, the way to time what the fused quantization saves. MILES_FP8_SPLIT_K=auto
cuts the K range of those GEMMs that have few output tiles into chunks on parallel streams (fp8_split_k.py).

Ends with one JSON line: bf16_tok_s, fp8_tok_s, tok_s_ratio, decode_step_ratio (BF16's median decode step over
FP8's), bf16_install_s, fp8_install_s, install_ratio,
bf16_push_s, fp8_push_s, push_ratio (the goal: <= 1.3), the FP8 side's kv_cache_dtype, fp8_cuda_kernels,
fused_input_quant (the switch), fused_input_quant_served (whether the FP8 engine's GEMMs took such inputs),
fp8_split_k and split_k_refused, fp8_gemm_form (MILES_FP8_GEMM_FORM) and the scale layout its probe kept
(fp8_gemm_form_layout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from engine_throughput import EngineSide, make_prompts, measure

from miles.config import EMBEDDED_KV_CACHE_DTYPES
from miles.engines.embedded import fp8, fp8_forms, fp8_split_k
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.request import decode_step_summary
from miles.models.tiny import make_tiny_model
from miles.weights.buffer_writer import BufferWriter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=18944)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--model-path", default=None, help="a bf16 HF directory instead of a random model")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--install-reps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=512, help="tensors per load_weights call, as a push's buckets")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=EMBEDDED_KV_CACHE_DTYPES,
        help="the FP8 engine's KV cache (the BF16 engine's stays in its dtype)",
    )
    p.add_argument(
        "--separate-input-quant",
        action="store_true",
        help="fp8.FUSED_INPUT_QUANT off: every FP8 GEMM on cuBLASLt quantizes its input in its own kernel",
    )
    return p.parse_args(argv)


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out, current, size = [], [], 0
    for name, t in named:
        current.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def install_s(engine: EmbeddedEngine, chunks: list[list[tuple[str, torch.Tensor]]], reps: int) -> float:
    """Median seconds to load every bucket into the engine (device work included)."""
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for chunk in chunks:
            engine.load_weights(chunk)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"install seconds per rep ({'fp8' if engine.fp8 else 'bf16'}): {[round(t, 4) for t in times[1:]]}")
    return statistics.median(times[1:])


def push_s(engine: EmbeddedEngine, source: list[tuple[str, torch.Tensor]], reps: int) -> float:
    """Median seconds of a direct colocated push of `source` into the engine (paused), install included."""
    export = engine.export_weight_buffer()
    writer = BufferWriter(engine._shared.arena.flat, export)  # noqa: SLF001 - the buffer a trainer maps by IPC
    times = []
    for rep in range(reps + 1):  # the first is a warm-up
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        writer.write(source)
        engine.install_weight_buffer(export["generation"], rep + 1)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"push seconds per rep ({'fp8' if engine.fp8 else 'bf16'}): {[round(t, 4) for t in times[1:]]}")
    return statistics.median(times[1:])


def make_model(args: argparse.Namespace, tmp: str) -> str:
    if args.model_path:
        return args.model_path
    return make_tiny_model(
        tmp,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        dtype="bfloat16",
        init_std=0.02,
        device=args.device,  # a GPU draws the 7B shape in seconds
    )


def fused_input_quant_served(engine: EmbeddedEngine) -> bool:
    """Whether the engine's norms and SiLU hand its FP8 GEMMs their inputs quantized: its forward is the fused
    one (the Triton kernels) and its qkv, gate/up or down GEMMs take such inputs (o's comes from attention)."""
    fed = [t for name, t in engine.model.storage.items() if not name.endswith("o_proj.weight")]
    return engine.runner.fused_kernels and any(fp8.takes_quantized_input(t) for t in fed)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.separate_input_quant:
        fp8.FUSED_INPUT_QUANT = False
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(args, tmp)
        kwargs = dict(
            device=args.device,
            dtype=dtype,
            max_running_requests=args.batch,
            max_total_tokens=args.batch * (args.prompt_len + args.new_tokens + 8),
        )
        engines = {
            "bf16": EmbeddedEngine(path, **kwargs),
            "fp8": EmbeddedEngine(path, quantization="fp8", kv_cache_dtype=args.kv_cache_dtype, **kwargs),
        }
    prompts = make_prompts(args.batch, args.prompt_len, engines["bf16"].model.spec.vocab_size)
    sides = {name: EngineSide(engine, prompts) for name, engine in engines.items()}
    # the trainer's tensors: bf16 copies of the bf16 engine's own (as a push would send them)
    source = [(n, t.to(torch.bfloat16).clone()) for n, t in engines["bf16"].model.params.items()]
    chunks = buckets(source, args.bucket_mb * 2**20)
    try:
        rates, timelines = measure(sides, args.new_tokens, args.reps)
        served = fused_input_quant_served(engines["fp8"])  # after the rounds: a refusal there turns it off
        pushes, installs = {}, {}
        for name, side in sides.items():  # while the engines live: their weights go with shutdown
            side.loop.run_until_complete(side.engine.pause_generation("retract"))
            pushes[name] = push_s(side.engine, source, args.install_reps)
            installs[name] = install_s(side.engine, chunks, args.install_reps)
    finally:
        for side in sides.values():
            side.close()
    steps = {name: decode_step_summary(timeline, args.batch) for name, timeline in timelines.items()}
    result = {
        "bf16_tok_s": round(rates["bf16"], 1),
        "fp8_tok_s": round(rates["fp8"], 1),
        "tok_s_ratio": round(rates["fp8"] / rates["bf16"], 3),
        # BF16's decode step over FP8's (medians over every full-batch step of the timed rounds): the decode
        # speed-up alone, steadier than the rounds' ratio when one side's round is slow outside its steps
        "decode_step_ratio": (
            round(steps["bf16"]["step_ms"] / steps["fp8"]["step_ms"], 3) if steps["bf16"] and steps["fp8"] else None
        ),
        "bf16_install_s": round(installs["bf16"], 4),
        "fp8_install_s": round(installs["fp8"], 4),
        "install_ratio": round(installs["fp8"] / installs["bf16"], 3),
        "bf16_push_s": round(pushes["bf16"], 4),
        "fp8_push_s": round(pushes["fp8"], 4),
        "push_ratio": round(pushes["fp8"] / pushes["bf16"], 3),
        # each side's full-batch decode steps as the host saw them (is the step the device's or the host's?)
        "decode_steps": steps,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": args.device,
        "kv_cache_dtype": args.kv_cache_dtype,
        "fp8_cuda_kernels": fp8.CUDA_KERNELS,
        "fused_input_quant": fp8.FUSED_INPUT_QUANT,
        "fused_input_quant_served": served,
        "fp8_split_k": fp8_split_k.SPLIT_K,  # MILES_FP8_SPLIT_K
        "split_k_refused": not all(fp8._split_ok.values()),
        "fp8_gemm_form": fp8_forms.FORM,  # MILES_FP8_GEMM_FORM
        "cublaslt_workspace_kib": fp8.CUBLASLT_WORKSPACE_KIB,  # CUBLASLT_WORKSPACE_SIZE, the engine's default unless set
        # the scale layout its probe kept on the device (None: torch took none, the block form served)
        "fp8_gemm_form_layout": fp8_forms.probed(fp8_forms.FORM),
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
    }
    print(
        f"FP8 (KV cache {args.kv_cache_dtype}) {rates['fp8']:,.0f} tok/s vs BF16 {rates['bf16']:,.0f} tok/s: {result['tok_s_ratio']:.2f}x "
        f"(decode step {result['decode_step_ratio']}x); "
        f"weight install {installs['fp8']:.3f} s vs {installs['bf16']:.3f} s: {result['install_ratio']:.2f}x; "
        f"colocated push {pushes['fp8']:.3f} s vs {pushes['bf16']:.3f} s: {result['push_ratio']:.2f}x"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
