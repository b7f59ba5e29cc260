"""The W8A8 block-scaled GEMMs of one decoder layer, side by side: cuBLASLt's against the Triton kernel's settings.

FP8 serving's decode step on the 7B shape spends most of its time in the block-scaled GEMMs, which read half
the bytes of bf16 ones and take about as long through cuBLASLt (`bench/results/fp8.md`). This times, for each
GEMM of a layer (qkv, o, gate/up, down) at `--batch` rows, the bf16 `F.linear`, cuBLASLt's block-scaled
`torch._scaled_mm` after the activation quantization kernel (the engine's path on Hopper, MILES_FP8_CUDA_KERNELS on by default)
and `fp8_triton.quantized_linear`, which quantizes the activation inside the GEMM (the path with
MILES_FP8_GEMM=triton too), at every setting of a small grid (rows and columns a tile, warps, pipeline stages,
`--triton-splits`, the K chunks the kernel sums apart; every setting's time in `triton_sweep`).
`--triton-input prequant` times the Triton kernel after the activation quantization kernel instead
(`block_scaled_mm`, as cuBLASLt's path): inside, every column tile quantizes its rows' activation again.
Both FP8 timings start from the bf16 activation; each output is checked against the fp32 product of the
activation kernel's codes. It prints one line per GEMM, then the layer's totals: bf16, cuBLASLt, the Triton
kernel at its default settings and at each GEMM's best, and the ratios. On Hopper it also times cuBLASLt's GEMM
cut into K chunks on parallel streams (fp8_split_k) at each count of --splits that the GEMM's K allows and at
MILES_FP8_SPLIT_K=auto's choice, each checked like the others (`cublas_split_us`, `cublas_auto_us`), and with
`--scale-layouts` the block-scaled forms torch offers beside the engine's on the same codes, the GEMM alone: both
operands in 1x128 groups (the weight's block scales repeated over their rows) and A and B swapped (the weight as
A, which gives cuBLASLt the large dimension as M; out^T copied back), per GEMM `cublas_layouts`, summed `layouts_us`.

    python bench/fp8_gemm.py --device cuda                                   # the Qwen2.5-7B layer, batch 256
    python bench/fp8_gemm.py --device cuda --hidden 896 --intermediate 4864 --heads 14 --kv-heads 2 --head-dim 64

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1) for its checks only; times there mean nothing.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from kernel_timing import ints, kernel_device

from miles.engines.embedded import fp8, fp8_forms, fp8_split_k, fp8_triton


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    for name, default in (("batch", 256), ("hidden", 3584), ("intermediate", 18944), ("heads", 28),
                          ("kv-heads", 4), ("head-dim", 128), ("reps", 50), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--block-m", type=ints, default=[32, 64, 128])
    p.add_argument("--block-n", type=ints, default=[64, 128])
    p.add_argument("--num-warps", type=ints, default=[4, 8])
    p.add_argument("--num-stages", type=ints, default=[3, 4])
    p.add_argument("--splits", type=ints, default=[2, 3, 4], help="K chunk counts of cuBLASLt's split GEMM")
    p.add_argument("--triton-splits", type=ints, default=[1], help="K chunk counts of the Triton kernel's grid")
    p.add_argument(
        "--triton-input",
        choices=("inside", "prequant"),
        default="inside",
        help="the Triton kernel quantizes the activation inside (quantized_linear) or takes the activation "
        "kernel's codes (quantize_activation, then block_scaled_mm)",
    )
    p.add_argument(
        "--scale-layouts",
        action="store_true",
        help="on Hopper, also time cuBLASLt's other block-scaled forms on the same codes (both operands 1x128, and "
        "A and B swapped), the GEMM alone (`cublas_layouts` per GEMM, `layouts_us` summed)",
    )
    return p.parse_args(argv)


def layer_gemms(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM of one decoder layer, the fused projections as the engine runs them."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return {
        "qkv": (q + 2 * kv, a.hidden),
        "o": (a.hidden, q),
        "gate_up": (2 * a.intermediate, a.hidden),
        "down": (a.hidden, a.intermediate),
    }


def _time_us(fn, reps: int, cuda: bool) -> float:
    fn()  # compiles, warms the caches of the library
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    # the engine replays these GEMMs inside CUDA graphs: time a graph of `reps` calls, so that the host's
    # launch work (a Python call per kernel) is not counted as the GEMM's (an eager loop made the small ones
    # host-bound: 60-117 us where the engine's graphed step spends ~35 us a GEMM)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()  # warm
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / reps


def _triton_gemm(x: torch.Tensor, weight: fp8.Fp8Weight, setting: tuple, prequant: bool) -> torch.Tensor:
    """The Triton GEMM at `setting` (block_m, block_n, warps, stages, K splits) from the bf16 activation."""
    tiles, splits = setting[:4], setting[4]
    if prequant:
        xq, xs = fp8_triton.quantize_activation(x, pad_to=4)
        return fp8_triton.block_scaled_mm(xq[: x.shape[0]], xs, weight.q, weight.scale_inv, x.dtype, tiles, splits)
    return fp8_triton.quantized_linear(x, weight.q, weight.scale_inv, settings=tiles, splits=splits)


def _triton_settings(
    x: torch.Tensor,
    weight: fp8.Fp8Weight,
    want: torch.Tensor,
    scale: float,
    grid: list,
    a: argparse.Namespace,
    cuda: bool,
) -> list[dict]:
    """Each Triton setting of `grid` on one GEMM: its time and largest difference from `want` relative to
    `scale` (want's largest value), or the error of a setting the compiler or the device refuses."""
    settings = []
    prequant = a.triton_input == "prequant"
    for s in grid:
        try:
            out = _triton_gemm(x, weight, s, prequant)
            us = _time_us(lambda s=s, w=weight, x=x: _triton_gemm(x, w, s, prequant), a.reps, cuda)
        except Exception as e:  # noqa: BLE001 - a setting the compiler or the device refuses is reported
            settings.append({"settings": list(s), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rel = (out.float() - want).abs().max().item() / scale
        settings.append({"settings": list(s), "us": round(us, 2), "rel_diff": rel})
    return settings


def _cublas_timings(
    x: torch.Tensor, weight: fp8.Fp8Weight, want: torch.Tensor, scale: float, a: argparse.Namespace, dtype
) -> dict:
    """cuBLASLt's block-scaled GEMM whole, in each allowed count of --splits K chunks, and at "auto"'s count:
    microseconds and largest difference from `want` relative to `scale`."""
    N, K = weight.q.shape
    counts = {"whole": 0} | {str(n): n for n in a.splits if fp8_split_k.splits_for(a.batch, N, K, x.device, n) == n}
    counts["auto"] = "auto"
    times, diffs = {}, {}
    for label, splits in counts.items():
        out = fp8._block_scaled_mm(x, weight, dtype, splits=splits)
        if out is None:
            break
        times[label] = round(
            _time_us(lambda x=x, w=weight, n=splits: fp8._block_scaled_mm(x, w, dtype, splits=n), a.reps, True), 2
        )
        diffs[label] = (out.float() - want).abs().max().item() / scale
    if "whole" not in times:
        return {}
    split_times = {k: v for k, v in times.items() if k not in ("whole", "auto")}
    return {
        "cublas_us": times["whole"],
        "cublas_rel_diff": max(diffs.values()),
        "cublas_split_us": split_times,
        "cublas_split_best_us": min([times["whole"], *split_times.values()]),
        "cublas_auto_us": times.get("auto"),
        "auto_splits": fp8_split_k.splits_for(a.batch, N, K, x.device, "auto"),
        "split_refused": not fp8._split_ok.get(x.device, True),
    }


def _cublas_layout_timings(
    weight: fp8.Fp8Weight, xq: torch.Tensor, xs: torch.Tensor, want: torch.Tensor, scale: float, reps: int
) -> dict:
    """Each block-scaled form of the same product that torch._scaled_mm offers on Hopper (fp8_forms: the engine's
    "block", "rows" and "swapped") from the activation's codes (the quantization not timed), at the first of its
    scale layouts that computes `want` (fp8_forms.first_layout): microseconds and largest difference from `want`
    relative to `scale`, or why none of its layouts did."""
    K = weight.q.shape[1]
    if (K // fp8.BLOCK) % 4:  # cuBLASLt's padded scale rows (fp8.pad_k_blocks): the 7B layer's K are whole fours
        return {}
    xs = xs.t().contiguous().t()  # [M, L], outer-dim-major, as the engine passes it
    rows = want.shape[0]
    timings = {}
    for form in fp8_forms.FORMS:
        layout, why = fp8_forms.first_layout(form, xq, xs, weight.q, weight.scale_inv, want)
        if layout is None:
            timings[form] = {"errors": why}
            continue

        def run(form=form, layout=layout):
            return fp8_forms.mm(form, layout, xq, xs, weight.q, weight.scale_inv, torch.bfloat16)

        rel = (run()[:rows].float() - want).abs().max().item() / scale
        timings[form] = {"layout": layout, "us": round(_time_us(run, reps, True), 2), "rel_diff": rel}
    return {"cublas_layouts": timings}


def _summary(rows: list[dict], batch: int, device_name: str, cuda: bool) -> dict:
    """The closing line: the layer's GEMMs summed per path, the paths' ratios, each GEMM's best setting."""

    def total(pick) -> float | None:
        values = [pick(r) for r in rows]
        return None if any(v is None for v in values) else round(sum(values), 2)

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else round(x / y, 3)

    layer = {
        "bf16": total(lambda r: r["bf16_us"]),
        "cublas": total(lambda r: r.get("cublas_us")),
        "cublas_split_best": total(lambda r: r.get("cublas_split_best_us")),
        "cublas_auto": total(lambda r: r.get("cublas_auto_us")),
        "triton_default": total(lambda r: r["triton_default"]["us"] if r["triton_default"] else None),
        "triton_best": total(lambda r: r["triton_best"]["us"] if r["triton_best"] else None),
    }
    return {
        "device": device_name,
        "batch": batch,
        "layer_us": layer,
        "triton_best_over_cublas": ratio(layer["triton_best"], layer["cublas"]),
        "triton_default_over_best": ratio(layer["triton_default"], layer["triton_best"]),
        "cublas_over_bf16": ratio(layer["cublas"], layer["bf16"]),
        "cublas_split_best_over_cublas": ratio(layer["cublas_split_best"], layer["cublas"]),
        "cublas_auto_over_cublas": ratio(layer["cublas_auto"], layer["cublas"]),
        "triton_best_over_bf16": ratio(layer["triton_best"], layer["bf16"]),
        "best_settings": {r["gemm"]: r["triton_best"]["settings"] if r["triton_best"] else None for r in rows},
        "worst_rel_diff": max(
            (r["triton_worst_rel_diff"] for r in rows if r["triton_worst_rel_diff"] is not None), default=None
        ),
        "refused": sum(len(r["refused"]) for r in rows),
        "timed_on_cpu": not cuda,  # the interpreter: checks only, the times mean nothing
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device, cuda, dtype = kernel_device(a.device)
    if cuda and torch.cuda.get_device_capability(device) < (8, 9):
        raise SystemExit(f"{torch.cuda.get_device_name(device)} has no e4m3 tensor cores (CUDA capability 8.9+)")
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    hopper = cuda and torch.cuda.get_device_capability(device)[0] == 9
    default_settings = (*fp8_triton.gemm_settings(a.batch), 1)
    grid = [default_settings] + [
        s
        for s in itertools.product(a.block_m, a.block_n, a.num_warps, a.num_stages, a.triton_splits)
        if s != default_settings and fp8_triton.GROUP % s[1] == 0
    ]
    rows = []
    for name, (N, K) in layer_gemms(a).items():
        x = torch.randn(a.batch, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) * 0.02).to(device, dtype)
        weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
        xq, xs = fp8_triton.quantize_activation(x, pad_to=4)
        # the product of the very codes both FP8 paths multiply (on the GPU the activation kernel's codes are the
        # torch form's; under the interpreter its e4m3 rounding is not), dequantized, in fp32
        dx = xq[: a.batch].float() * xs[: a.batch].repeat_interleave(fp8.BLOCK, 1)[:, :K]
        want = F.linear(dx, fp8.dequantize_weight(weight.q, weight.scale_inv))
        scale = want.abs().max().item()
        line: dict = {"gemm": name, "n": N, "k": K, "weight_mb": round(N * K / 2**20, 1)}
        line["bf16_us"] = round(_time_us(lambda x=x, w=w: F.linear(x, w), a.reps, cuda), 2)
        if hopper and K % fp8.BLOCK == 0 and N % fp8.BLOCK == 0:  # the engine's condition for cuBLASLt
            line |= _cublas_timings(x, weight, want, scale, a, dtype)
            if a.scale_layouts:
                line |= _cublas_layout_timings(weight, xq, xs, want, scale, a.reps)
        settings = _triton_settings(x, weight, want, scale, grid, a, cuda)
        timed = [s for s in settings if "us" in s]
        line["triton_default"] = timed[0] if timed and timed[0]["settings"] == list(default_settings) else None
        line["triton_best"] = min(timed, key=lambda s: s["us"]) if timed else None
        line["triton_sweep"] = {",".join(map(str, s["settings"])): s["us"] for s in timed}  # every setting's time
        line["triton_worst_rel_diff"] = max((s["rel_diff"] for s in timed), default=None)  # every setting checked
        line["refused"] = [s for s in settings if "error" in s]
        print(json.dumps(line), flush=True)
        rows.append(line)

    result = _summary(rows, a.batch, torch.cuda.get_device_name(device) if cuda else "cpu", cuda)
    result["triton_input"] = a.triton_input
    result["cublaslt_workspace_kib"] = (
        fp8.CUBLASLT_WORKSPACE_KIB
    )  # CUBLASLT_WORKSPACE_SIZE (the engine's default unless set)
    if a.scale_layouts:  # each form's GEMMs summed over the layer, where every GEMM ran it
        forms = {label for r in rows for label in r.get("cublas_layouts", {})}
        result["layouts_us"] = {
            label: round(sum(r["cublas_layouts"][label]["us"] for r in rows), 2)
            for label in sorted(forms)
            if all("us" in r.get("cublas_layouts", {}).get(label, {}) for r in rows)
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
