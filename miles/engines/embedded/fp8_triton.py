"""Triton kernels of FP8 serving (fp8.py): one pass each over the data, where the torch forms take five.

`quantize_activation`: per token and group of 128 channels, dynamic scale amax / 448; the scales come out
outer-dim-major ([M, K/128] with M contiguous), the layout torch._scaled_mm's 1x128 operand wants.
`quantize_weight`: per 128x128 block, scale_inv = amax / 448; what a weight push runs per tensor.
Both compute in fp32 and round to e4m3 as torch's `.to(float8_e4m3fn)` does (nearest, saturated first).
`block_scaled_mm`: the W8A8 GEMM itself, x [M, K] with its 1x128 scales times w [N, K] with its 128x128 ones:
each 128-deep slice of K is one e4m3 tensor-core product accumulated in fp32 and scaled by its row's and its
block's scales (the emulation's sum of dequantized products, in another order). Any K (the last slice
masked, so no padding to whole blocks of four) and any N; on CUDA it needs e4m3 tensor cores (capability 8.9+).
`quantized_linear`: the same GEMM taking the activation in the model dtype and quantizing each slice as
`quantize_activation` would, inside the GEMM (one launch instead of two, no e4m3 copy of the activation).
The arithmetic of one group's quantization is `triton_kernels.scaled_groups`, which the engine's norm and SiLU
kernels also call when they hand an FP8 GEMM its input already quantized (fp8.QuantizedInput).
"""

from __future__ import annotations

import torch

from miles.engines.embedded.triton_kernels import available, tl, triton

E4M3_MAX = 448.0
GROUP = 128
ACT_BLOCK_M = 16  # rows a program of the activation quantization takes

if triton is not None:
    # one group's quantization, shared with the norm and SiLU kernels that quantize their outputs (the same codes)
    from miles.engines.embedded.triton_kernels import scaled_groups

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_pad, K, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """Rows [p*BLOCK_M, (p+1)*BLOCK_M), group g: q = x / s per row, s[g * M_pad + m] = amax / 448 (rows in
        [M, M_pad): zeros). A tile of rows per program: one row's group is only 256 bytes, and the tile's
        scales are one contiguous store."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        offs = rows[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0).to(tl.float32)
        q, scale = scaled_groups(x)
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

    @triton.jit
    def _block_scaled_mm_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xs_m, stride_xs_k, stride_ws_n,
        KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUP_M: tl.constexpr,
        QUANT_X: tl.constexpr, KB_PER: tl.constexpr,
    ):  # fmt: skip
        """out[tile] = sum over K slices kb of (x[tile rows, kb] @ w[tile cols, kb].T) * xs[rows, kb] * ws[nb, kb],
        nb the 128-row block of the tile's columns (BLOCK_N divides 128, so a tile's columns share it). Tiles
        are visited GROUP_M row tiles at a time per column tile, so a weight tile read from HBM serves them
        from L2. QUANT_X: x is the activation in the model dtype, each slice quantized here as
        `_act_quant_kernel` does (the same codes and scales; xs unused), so no separate launch and no e4m3
        copy of the activation. Split-K (KB_PER < KB): program (tile, s) sums slices [s * KB_PER, (s + 1) *
        KB_PER) and stores its fp32 partial tile at out_ptr + s * M * N, for the caller to sum."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, GROUP)
        row_ok, col_ok = rows < M, cols < N
        # KB_PER slices from first_kb (past KB masked: the last chunk may be short), a constant trip count
        first_kb = tl.program_id(1) * KB_PER
        offs = tl.program_id(1).to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]  # a split's own plane
        x_ptrs = x_ptr + rows[:, None] * K + first_kb * GROUP + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * K + first_kb * GROUP + ks[None, :]
        ws_row = ws_ptr + ((pid_n * BLOCK_N) // GROUP).to(tl.int64) * stride_ws_n
        xs_rows = xs_ptr + rows * stride_xs_m
        # the scales of slice i + 1 are loaded while slice i multiplies: Triton's pipeliner stages only the tiles
        # that feed the MMA, so a scale loaded where it is used would stall every slice on a global load
        if not QUANT_X:  # with QUANT_X the row scales come from each slice's own quantization
            next_xs = tl.load(xs_rows + first_kb * stride_xs_k, mask=row_ok & (first_kb < KB), other=0.0)
        next_ws = tl.load(ws_row + first_kb, mask=first_kb < KB, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, KB_PER):
            kb = first_kb + i
            k_ok = ks[None, :] < K - kb * GROUP
            ahead = (kb + 1 < KB) & (i + 1 < KB_PER)
            w_scale = next_ws
            next_ws = tl.load(ws_row + kb + 1, mask=ahead, other=0.0)
            if QUANT_X:
                xf = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok, other=0.0).to(tl.float32)
                x, x_scale = scaled_groups(xf)
                x = x.to(w_ptr.dtype.element_ty)
            else:
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
                x_scale = next_xs
                next_xs = tl.load(xs_rows + (kb + 1) * stride_xs_k, mask=row_ok & ahead, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * (x_scale[:, None] * w_scale)
            x_ptrs += GROUP
            w_ptrs += GROUP
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


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


# the GEMM's launch settings: (block_m, block_n, num_warps, num_stages), by how many rows M has. On an H200
# bench/fp8_gemm.py's sweep found the best per GEMM of a 7B layer within 9% of these over the layer.
# Up to a decode batch of 256 rows, tiles of at most 64 rows: more programs for the GPU's SMs (the o projection
# of the 7B shape has 28 column tiles), each weight tile served to the row tiles from L2.
GEMM_SETTINGS = {16: (16, 128, 4, 4), 32: (32, 128, 4, 4), 256: (64, 128, 4, 3)}
GEMM_SETTINGS_LARGE = (128, 128, 8, 3)
GEMM_GROUP_M = 8


def gemm_settings(M: int) -> tuple[int, int, int, int]:
    for rows, setting in GEMM_SETTINGS.items():
        if M <= rows:
            return setting
    return GEMM_SETTINGS_LARGE


def block_scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype,
    settings: tuple[int, int, int, int] | None = None,
    splits: int = 1,
) -> torch.Tensor:
    """xq [M, K] e4m3 with scales xs [>= M, ceil(K/128)] fp32 (any strides: the activation quantization's
    outer-dim-major ones too) times wq [N, K] e4m3 with ws [ceil(N/128), ceil(K/128)] fp32, transposed:
    [M, N] in `out_dtype`. `settings`: (block_m, block_n, num_warps, num_stages), default `gemm_settings(M)`.
    `splits` > 1 cuts K's 128-slices into that many chunks (fewer where K has fewer slices), one program per
    tile and chunk, whose fp32 partial tiles are summed and rounded once: more programs for a GEMM of few
    output tiles."""
    return _launch(xq, xs, wq, ws, out_dtype, settings, quant_x=False, splits=splits)


def quantized_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    settings: tuple[int, int, int, int] | None = None,
    splits: int = 1,
) -> torch.Tensor:
    """x [M, K] (model dtype) times wq [N, K] e4m3 with ws, transposed, as `block_scaled_mm` of x's 1x128
    quantization, which the GEMM computes slice by slice (one launch; the codes `quantize_activation` gives)."""
    return _launch(x, x, wq, ws, out_dtype or x.dtype, settings, quant_x=True, splits=splits)


def _launch(x, xs, wq, ws, out_dtype, settings, *, quant_x: bool, splits: int = 1) -> torch.Tensor:
    M, K = x.shape
    N = wq.shape[0]
    KB = -(-K // GROUP)
    x_scales_ok = quant_x or (xs.shape[0] >= M and xs.shape[1] == KB)
    if wq.shape[1] != K or ws.shape != (-(-N // GROUP), KB) or not x_scales_ok:
        x_scales = "" if quant_x else f" with scales {tuple(xs.shape)}"
        raise ValueError(
            f"block_scaled_mm: x {tuple(x.shape)}{x_scales} and w {tuple(wq.shape)} with scales {tuple(ws.shape)} "
            "do not make one 128-block-scaled product"
        )
    block_m, block_n, num_warps, num_stages = settings or gemm_settings(M)
    if GROUP % block_n:
        raise ValueError(f"block_n={block_n} must divide {GROUP}: a tile's columns share one weight scale row")
    if splits < 1:
        raise ValueError(f"block_scaled_mm: splits={splits}; use 1 (whole K) or more")
    x, wq = x.contiguous(), wq.contiguous()
    kb_per = -(-KB // splits)
    planes = -(-KB // kb_per)  # chunks of kb_per slices, none empty
    if planes == 1:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    else:
        out = torch.empty((planes, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), planes)
    _block_scaled_mm_kernel[grid](
        x, xs, wq, ws, out, M, N, K, xs.stride(0), xs.stride(1), ws.stride(0),
        KB=KB, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=GROUP, GROUP_M=GEMM_GROUP_M, QUANT_X=quant_x,
        KB_PER=KB if planes == 1 else kb_per, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out if planes == 1 else out.sum(0).to(out_dtype)
