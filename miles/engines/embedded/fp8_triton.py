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

if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_pad, K, GROUP: tl.constexpr):
        """Row m, group g: q[m, g*128:(g+1)*128] = x / s, s[g * M_pad + m] = amax / 448 (rows >= M: zeros)."""
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        cols = g * GROUP + tl.arange(0, GROUP)
        x = tl.load(x_ptr + m * K + cols, mask=(cols < K) & (m < M), other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + m * K + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(s_ptr + g * M_pad + m, scale)

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
    _act_quant_kernel[(M_pad, G)](x, q, scales, M, M_pad, K, GROUP=GROUP)
    return q, scales.t()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] e4m3, scale_inv [ceil(N/128), ceil(K/128)] fp32), one program per block."""
    N, K = w.shape
    NB, KB = -(-N // GROUP), -(-K // GROUP)
    w = w.contiguous()
    q = torch.empty((N, K), dtype=torch.float8_e4m3fn, device=w.device)
    scale_inv = torch.empty((NB, KB), dtype=torch.float32, device=w.device)
    _weight_quant_kernel[(NB, KB)](w, q, scale_inv, N, K, KB, BLOCK=GROUP)
    return q, scale_inv
