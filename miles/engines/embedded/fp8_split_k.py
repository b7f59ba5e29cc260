"""Split-K for cuBLASLt's block-scaled FP8 GEMMs of few output tiles: the K range cut into chunks that run at once.

At decode batch sizes a GEMM's output has few 128 x 128 tiles: the 7B shape's down projection at 256 rows has
2 x 28 = 56, on an H100's or H200's 132 SMs, and cuBLASLt's block-scaled kernel gives each tile one program over
the whole K (18,944). An H100 timed it at 60 us in a CUDA graph, against ~20 us for its 68 MB of e4m3 weights at
that GPU's 3.35 TB/s and ~18 us for its FLOPs at the FP8 peak (`bench/results/fp8.md`). Here the K range is cut into chunks of
whole groups of four 128-blocks (cuBLASLt's scale layout: see fp8.pad_k_blocks); each chunk's GEMM runs on a
stream of its own, forked from and joined back to the current one (inside a CUDA graph they become parallel
branches), writes fp32, and the chunks are summed and rounded once to the model dtype: the same W8A8 product
up to the order of the fp32 sums.

MILES_FP8_SPLIT_K (refused at import with MILES_FP8_CUDA_KERNELS=0 or the Triton GEMM): "0" (off, the
default: on an H100 auto made the 7B down projection 11% faster and the engine no faster, bench/results/fp8.md),
"auto" (as many chunks as the SMs hold copies of the output's tiles, at most MAX_SPLITS and no chunk under
AUTO_MIN_CHUNK_BLOCKS blocks of K), or a fixed count.
`bench/fp8_gemm.py --splits` times each count beside the whole GEMM.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

BLOCK = 128  # the FP8 quantization block (fp8.BLOCK reads it from here: fp8 imports this module)
GROUP_BLOCKS = 4  # cuBLASLt reads the weight scales in groups of four 128-blocks of K
TILE = 128  # the output tile assumed by "auto"
MAX_SPLITS = 4
# "auto" keeps at least this many 128-blocks of K in a chunk: a chunk's share of the scale copy, the fp32 sum and
# the cast (three small kernels, a few microseconds) must stay small beside its GEMM
AUTO_MIN_CHUNK_BLOCKS = 32


def parse(text: str) -> int | str:
    """MILES_FP8_SPLIT_K's value: 0 (off), "auto" or a chunk count from 1 to MAX_SPLITS."""
    if text == "auto":
        return text
    if text.isdigit() and int(text) <= MAX_SPLITS:
        return int(text)
    raise ValueError(f"MILES_FP8_SPLIT_K={text!r}: use 0 (off), auto, or a chunk count up to {MAX_SPLITS}")


SPLIT_K: int | str = parse(os.environ.get("MILES_FP8_SPLIT_K", "0"))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def splits_for(rows: int, n: int, k: int, device: torch.device, policy: int | str | None = None) -> int:
    """How many K chunks the GEMM of `rows` x `n` outputs over `k` runs in under `policy` (SPLIT_K when None):
    1 where K is not whole groups of four blocks (the padded path stays whole) or has fewer groups than chunks."""
    policy = SPLIT_K if policy is None else policy
    groups = k // (BLOCK * GROUP_BLOCKS) if k % (BLOCK * GROUP_BLOCKS) == 0 else 0
    if policy == "auto":
        tiles = -(-rows // TILE) * -(-n // TILE)
        policy = min(_sm_count(device) // tiles, k // (BLOCK * AUTO_MIN_CHUNK_BLOCKS), MAX_SPLITS)
    return max(1, min(int(policy), groups))


def chunk_blocks(blocks: int, splits: int) -> list[tuple[int, int]]:
    """[start, end) in 128-blocks of each of `splits` chunks of `blocks` (a multiple of four): whole groups of
    four, as even as they divide."""
    groups = blocks // GROUP_BLOCKS
    edges = [GROUP_BLOCKS * (i * groups // splits) for i in range(splits + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


@functools.cache
def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, ...]:
    # made at the first (eager) call: the engine warms every graph up before capturing it
    return tuple(torch.cuda.Stream(device) for _ in range(MAX_SPLITS - 1))


def split_k_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    dtype: torch.dtype,
    splits: int,
    mm: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 with scales xs [M, L] (outer-dim-major) times wq [N, K] e4m3 with 128x128 scales ws [NB, L]
    (L % 4 == 0) in `splits` K chunks, each by `mm` (torch._scaled_mm's signature; torch._scaled_mm when None),
    on CUDA each on its own stream; returns the sum in `dtype`."""
    mm = torch._scaled_mm if mm is None else mm
    chunks = chunk_blocks(ws.shape[1], splits)
    # cuBLASLt reads a chunk's weight scales with a leading dimension of its own block count: each chunk's copy
    # (small: NB x chunk blocks), made at every call (and every graph replay) rather than cached, since pushes
    # write the scales in place, the colocated one from the trainer's process through CUDA IPC; the activation's
    # scales are outer-dim-major, so a column range is one piece
    scales = [ws[:, a:b].contiguous() for a, b in chunks]

    def chunk(i: int) -> torch.Tensor:
        (a, b), k0, k1 = chunks[i], chunks[i][0] * BLOCK, chunks[i][1] * BLOCK
        return mm(xq[:, k0:k1], wq[:, k0:k1].t(), scale_a=xs[:, a:b], scale_b=scales[i].t(), out_dtype=torch.float32)

    if not xq.is_cuda:
        parts = [chunk(i) for i in range(splits)]
    else:
        main = torch.cuda.current_stream(xq.device)
        side = _side_streams(xq.device)[: splits - 1]
        parts = [None] * splits
        for i, stream in enumerate(side, start=1):
            stream.wait_stream(main)  # the inputs and scale copies are written on main
            with torch.cuda.stream(stream):
                parts[i] = chunk(i)
        parts[0] = chunk(0)
        for stream in side:
            main.wait_stream(stream)
    total = parts[0]
    for part in parts[1:]:
        total = total.add_(part)
    return total.to(dtype)
