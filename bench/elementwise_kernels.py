"""The decode step's norm and SiLU kernels at one shape, their launch settings side by side.

A graphed FP8 decode step of the 7B shape on an H100 spends about 0.55 ms of its 6.7 in the RMSNorm kernels
(`triton_ops.add_rms_norm`, two a layer: the residual add, the norm, and with FP8 the next GEMM's input
quantized) and the SiLU * up kernel (`triton_ops.silu_mul`, quantizing the down projection's input), against
about 0.38 ms at the HBM rate over the bytes they move (bench/results/fp8.md). This times each kernel over
`--layers` distinct sets of buffers in a CUDA graph (as a decode step runs them: from HBM, not L2), per launch
setting (the norm's warps; SiLU's columns a program and warps), quantizing or not, and prints per setting the
microseconds a call, the bytes' rate and the largest difference of its output from the engine's default
setting's; then the best against the default, per kernel.

    python bench/elementwise_kernels.py --device cuda                                  # the 7B shape, batch 256
    python bench/elementwise_kernels.py --device cuda --hidden 896 --intermediate 4864 --layers 24   # the 0.5B

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1) for its checks only; times there mean nothing.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from kernel_timing import ints, kernel_device, time_us

from miles.engines.embedded import fp8, triton_ops


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    for name, default in (("batch", 256), ("hidden", 3584), ("intermediate", 18944), ("layers", 28),
                          ("replays", 20), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--norm-warps", type=ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--silu-block", type=ints, default=[512, 1024, 2048, 4096])
    p.add_argument("--silu-warps", type=ints, default=[2, 4, 8])
    return p.parse_args(argv)


def _values(out: torch.Tensor | fp8.QuantizedInput) -> torch.Tensor:
    return out.dequantize() if isinstance(out, fp8.QuantizedInput) else out.float()


def sweep(name: str, settings: list[dict], call, buffers: list[tuple], nbytes: int, a, cuda: bool) -> dict:
    """Each setting of one kernel: its time a call over the buffers, its rate, its output against the first's."""
    pristine = [b.clone() for b in buffers[0]]  # the norm adds into its residual: every setting scores fresh inputs
    rows, reference = [], None
    for setting in settings:
        try:
            out = _values(call(*(b.clone() for b in pristine), **setting))  # compiles
            us = time_us(lambda *bufs, s=setting: call(*bufs, **s), buffers, a.replays, cuda)
        except Exception as e:  # noqa: BLE001 - a setting the compiler or the device refuses is reported
            rows.append({**setting, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        reference = out if reference is None else reference
        diff = (out - reference).abs().max().item()
        rows.append({**setting, "us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1), "max_diff": diff})
        print(json.dumps({"kernel": name, **rows[-1]}), flush=True)
    timed = [r for r in rows if "us" in r]
    if not timed:
        raise SystemExit(f"elementwise_kernels: no setting of {name} ran: {rows[0]['error']}")
    best = min(timed, key=lambda r: r["us"])
    return {"default": timed[0], "best": best, "default_over_best": round(timed[0]["us"] / best["us"], 3),
            "refused": [r for r in rows if "error" in r], "mb_per_call": round(nbytes / 2**20, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device, cuda, dtype = kernel_device(a.device)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    B, H, N = a.batch, a.hidden, a.intermediate
    norm_w = (torch.rand(H, generator=g) + 0.5).to(device, dtype)
    norm_bufs = [
        (torch.randn(B, H, generator=g).to(device, dtype), torch.randn(B, H, generator=g).to(device, torch.float32))
        for _ in range(a.layers)
    ]  # fmt: skip
    silu_bufs = [(torch.randn(B, 2 * N, generator=g).to(device, dtype),) for _ in range(a.layers)]
    size = torch.empty(0, dtype=dtype).element_size()
    norm_default = [{"num_warps": triton_ops.NORM_WARPS}]
    silu_default = [{"block": triton_ops.SILU_BLOCK, "num_warps": triton_ops.SILU_WARPS}]
    norm_grid = norm_default + [{"num_warps": w} for w in a.norm_warps if w != triton_ops.NORM_WARPS]
    silu_grid = silu_default + [
        {"block": b, "num_warps": w}
        for b, w in itertools.product(a.silu_block, a.silu_warps)
        if {"block": b, "num_warps": w} != silu_default[0]
    ]
    result = {"device": str(device), "shape": {"batch": B, "hidden": H, "intermediate": N, "layers": a.layers}}
    for quantize in (True, False):
        tag = "quantized" if quantize else "model_dtype"
        out_bytes = B * H * (1 if quantize else size)
        # x read, the fp32 residual read and written, the output written
        result[f"norm_{tag}"] = sweep(
            f"norm_{tag}", norm_grid,
            lambda x, res, q=quantize, **s: triton_ops.add_rms_norm(x, res, norm_w, 1e-6, quantize=q, **s),
            norm_bufs, B * H * (size + 8) + out_bytes, a, cuda,
        )  # fmt: skip
        result[f"silu_{tag}"] = sweep(
            f"silu_{tag}", silu_grid,
            lambda gu, q=quantize, **s: triton_ops.silu_mul(gu, quantize=q, **s),
            silu_bufs, B * 2 * N * size + B * N * (1 if quantize else size), a, cuda,
        )  # fmt: skip
    result["timed_on_cpu"] = not cuda
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
