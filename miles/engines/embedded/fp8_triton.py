"""Triton kernels of FP8 serving (fp8.py): one pass each over the data, where the torch forms take five.

`quantize_activation`: per token and group of 128 channels, dynamic scale amax / 448; the scales come out
outer-dim-major ([M, K/128] with M contiguous), the layout torch._scaled_mm's 1x128 operand wants.
`quantize_weight`: per 128x128 block, scale_inv = amax / 448; what a weight push runs per tensor.
Both compute in fp32 and round to e4m3 as torch's `.to(float8_e4m3fn)` does (nearest, saturated first).
"""

from __future__ import annotations

import torch

from miles.engines.embedded.triton_kernels import tl, triton
from miles.engines.embedded.triton_ops import available

E4M3_MAX = 448.0
GROUP = 128
ACT_BLOCK_M = 16  # rows a program of the activation quantization takes

if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_pad, K, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """Rows [p*BLOCK_M, (p+1)*BLOCK_M), group g: q = x / s per row, s[g * M_pad + m] = amax / 448 (rows in
        [M, M_pad): zeros). A tile of rows per program: one row's group is only 256 bytes, and the tile's
        scales are one contiguous store."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        offs = rows[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
        kept = rows < M_pad
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=kept[:, None] & (cols[None, :] < K))
        tl.store(s_ptr + tl.program_id(1).to(tl.int64) * M_pad + rows, scale, mask=kept)

    @triton.jit
    def _weight_quant_kernel(w_ptr, q_ptr, s_ptr, N, K, KB, BLOCK: tl.constexpr):
        """Block (i, j) of w [N, K]: q = w / s, s_ptr[i * KB + j] = amax / 448."""
        i = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        rows = i * BLOCK + tl.arange(0, BLOCK)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        offs = rows[:, None] * K + cols[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(w / scale, -448.0), 448.0)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + i * KB + j, scale)


def runs_on(device: torch.device) -> bool:
    return available(device)


def quantize_activation(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> q [M_pad, K] e4m3 (rows past M zero), scales [M_pad, K/128] fp32 with
    stride (1, M_pad); M_pad = M rounded up to a multiple of `pad_to`."""
    M, K = x.shape
    M_pad = -(-M // pad_to) * pad_to
    G = K // GROUP
    x = x.contiguous()
    q = torch.empty((M_pad, K), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((G, M_pad), dtype=torch.float32, device=x.device)
    block_m = min(ACT_BLOCK_M, triton.next_power_of_2(M_pad))
    _act_quant_kernel[(triton.cdiv(M_pad, block_m), G)](x, q, scales, M, M_pad, K, GROUP=GROUP, BLOCK_M=block_m)
    return q, scales.t()


def quantize_weight(
    w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] e4m3, scale_inv [ceil(N/128), ceil(K/128)] fp32), one program per block; `out`:
    contiguous tensors of those shapes to write into (a weight's own storage: no temporary)."""
    N, K = w.shape
    NB, KB = -(-N // GROUP), -(-K // GROUP)
    w = w.contiguous()
    if out is None:
        q = torch.empty((N, K), dtype=torch.float8_e4m3fn, device=w.device)
        scale_inv = torch.empty((NB, KB), dtype=torch.float32, device=w.device)
    else:
        q, scale_inv = out
        if not (q.is_contiguous() and scale_inv.is_contiguous()):
            raise ValueError("quantize_weight(out=...) writes contiguous tensors")
    _weight_quant_kernel[(NB, KB)](w, q, scale_inv, N, K, KB, BLOCK=GROUP)
    return q, scale_inv
