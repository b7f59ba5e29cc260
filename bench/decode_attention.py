"""The decode attention kernel's launch settings at one shape, side by side: which ones read the KV fastest.

The graphed decode step of the 0.5B shape spends about a quarter of its time in the RoPE + KV-write +
attention kernel (`DecodeAttention.rope_attend`, `bench/results/engine_throughput.md`), at about half the
HBM rate over the KV it reads. This sweeps the kernel's launch settings (warps, pipeline stages, keys per
inner block, programs per SM and so the key splits) over one batch of rows, each setting in a CUDA graph of
`--layers` calls over as many distinct caches (as a decode step runs them, so the KV comes from HBM, not
L2), and prints per setting the microseconds per call, the KV read rate, and the largest difference of its
output from the engine's default setting's; then the best against the default.

    python bench/decode_attention.py --device cuda                      # the 0.5B shape, batch 256, 256 keys
    python bench/decode_attention.py --device cuda --num-warps 4,8 --block-n 64,128
    python bench/decode_attention.py --device cuda --heads 28 --kv-heads 4 --head-dim 128 --layers 28 \
        --kv-cache-dtype fp8_e4m3                                       # the 7B shape, an FP8 cache

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1) for its checks only; times there mean nothing.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from kernel_timing import ints, kernel_device, time_us

from miles.config.sections.engine import EMBEDDED_KV_CACHE_DTYPES
from miles.engines.embedded import triton_ops
from miles.engines.embedded.kv_cache import storage_dtype

DEFAULT = {"num_warps": 4, "num_stages": 2, "block_n": 64, "programs_per_sm": 2, "blocks_per_split": 4}
SWEPT = tuple(DEFAULT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    for name, default in (("batch", 256), ("heads", 14), ("kv-heads", 2), ("head-dim", 64), ("context", 256),
                          ("layers", 24), ("replays", 20), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--capacity", type=int, default=0, help="cache positions per slot (default: 1.5 x context)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=EMBEDDED_KV_CACHE_DTYPES,
        help="what the caches store, as the engine's flag: auto (the model's dtype) or an FP8 format",
    )
    p.add_argument("--bias", action="store_true", help="the kernel adds a q/k/v bias (as an FP8 qkv GEMM's)")
    p.add_argument("--num-warps", type=ints, default=[2, 4, 8])
    p.add_argument("--num-stages", type=ints, default=[2, 3])
    p.add_argument("--block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--programs-per-sm", type=ints, default=[1, 2, 4])
    p.add_argument("--blocks-per-split", type=ints, default=[4])
    return p.parse_args(argv)


def settings_grid(a: argparse.Namespace) -> list[dict[str, int]]:
    """Every combination asked for, the default first (added if the grid lacks it)."""
    grid = [
        dict(zip(SWEPT, values, strict=True))
        for values in itertools.product(a.num_warps, a.num_stages, a.block_n, a.programs_per_sm, a.blocks_per_split)
    ]
    return [DEFAULT, *(s for s in grid if s != DEFAULT)]


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device, cuda, dtype = kernel_device(a.device)
    cap = a.capacity or -(-(a.context * 3 // 2) // 64) * 64
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    B, H, KVH, HD = a.batch, a.heads, a.kv_heads, a.head_dim
    qkv = torch.randn(B, (H + 2 * KVH) * HD, generator=g).to(device, dtype)
    stored = storage_dtype(a.kv_cache_dtype, dtype)  # N(0, 1) values: within every FP8 format's range
    caches = [
        (torch.randn(B, KVH, cap, HD, generator=g).to(device, stored), torch.randn(B, KVH, cap, HD, generator=g).to(device, stored))
        for _ in range(a.layers)
    ]  # fmt: skip
    positions = torch.full((B,), a.context - 1, device=device)
    lens = positions + 1
    table = torch.randn(cap, 2 * HD, generator=g).to(
        device
    )  # the RoPE table's shape; its values only feed the comparison
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
    kv_bytes = B * KVH * a.context * HD * 2 * caches[0][0].element_size()

    bias = torch.randn(qkv.shape[1], generator=g).to(device, dtype) if a.bias else None

    def call(attn, k, v) -> torch.Tensor:
        return attn.rope_attend(qkv, positions, lens, table, k, v, bias=bias)

    rows, reference = [], None
    for setting in settings_grid(a):
        attn = triton_ops.DecodeAttention(H, KVH, HD, cap, sms, **setting)
        try:
            out = call(attn, *caches[0])  # compiles
            us = time_us(functools.partial(call, attn), caches, a.replays, cuda)
        except Exception as e:  # noqa: BLE001 - a setting the compiler or the device refuses is reported, not fatal
            rows.append({**setting, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        reference = out.float() if reference is None else reference
        diff = (out.float() - reference).abs().max().item()
        rows.append({**setting, "splits": attn.splits(B), "us": round(us, 2),
                     "kv_gbps": round(kv_bytes / us / 1e3, 1), "max_diff": diff})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    default = timed[0]
    result = {
        "device": str(device),
        "shape": {"batch": B, "heads": H, "kv_heads": KVH, "head_dim": HD, "context": a.context, "capacity": cap},
        "kv_cache_dtype": a.kv_cache_dtype,
        "bias": a.bias,
        "kv_mb_per_call": round(kv_bytes / 2**20, 2),
        "default": default,
        "best": best,
        "default_over_best": round(default["us"] / best["us"], 3),
        "refused": [r for r in rows if "error" in r],
        "timed_on_cpu": not cuda,  # the interpreter: checks only, the times mean nothing
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
