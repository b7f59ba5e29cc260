"""The Triton kernels of the embedded engine (their host launchers are in triton_ops.py).

Each kernel computes in fp32 and rounds once on store. The kernels index every tensor as dense row-major
memory (`ptr + row * width + col`); the launchers make inputs dense and check the tensors written in place.
The KV cache may be stored in FP8 (kv_cache.py, scale 1): its writes saturate at the format's largest value
(`_to_cache`), and its reads are widened to the model's dtype before any math (`_from_cache`).
Without triton installed the module defines no kernels (`triton` and `tl` are None); `available()` says
where they run (here, below every module that launches them: fp8_triton.py asks it too).
The norm and SiLU kernels can store their output as the FP8 GEMM's quantized input instead (QUANT): e4m3 codes
and per-128-channel scales, as fp8_triton's activation quantization would give for the stored output.
"""

from __future__ import annotations

import os

import torch

try:  # triton ships with CUDA builds of torch; CPU installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """True where the kernels can run on `device` (CUDA with triton, or any device when interpreting)."""
    if triton is None:
        return False
    return INTERPRET or device.type == "cuda"


if triton is not None:

    @triton.jit
    def scaled_groups(x):
        """x [rows, group] fp32 -> (x / s clamped to the e4m3 range, s = amax / 448 per row): one group's dynamic
        activation quantization before the cast. Every kernel that quantizes an activation (fp8_triton's, the
        GEMM that quantizes inside, the norm and SiLU below) calls this one, so all give the same codes."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        return tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0), scale

    @triton.jit
    def store_e4m3_groups(v, q_ptr, s_ptr, row, first_col, width, m_pad, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """Columns [first_col, first_col + BLOCK) of output row `row`, v [BLOCK] fp32 (first_col a multiple of
        GROUP, width too), quantized per GROUP columns as fp8_triton.quantize_activation stores them: codes at
        q_ptr + row * width + col, scales at s_ptr + (col // GROUP) * m_pad + row (outer-dim-major); columns
        past `width` are not stored."""
        q, scale = scaled_groups(tl.reshape(v, (BLOCK // GROUP, GROUP)))
        groups = first_col // GROUP + tl.arange(0, BLOCK // GROUP)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=cols < width)
        tl.store(s_ptr + groups * m_pad + row, scale, mask=groups < width // GROUP)

    @triton.jit
    def _to_cache(x, cache_ptr, KV_MAX: tl.constexpr):
        """x as the cache stores it. KV_MAX > 0 (an FP8 cache): clamped to +-KV_MAX first, as the cast alone
        may give NaN or inf past the format's range (kv_cache.py)."""
        if KV_MAX > 0:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -KV_MAX), KV_MAX)
        return x.to(cache_ptr.dtype.element_ty)

    @triton.jit
    def _from_cache(x, like):
        """Cache values x in the dtype of `like` (the model's); FP8 by way of fp32, which holds each exactly."""
        if x.dtype.is_fp8():
            x = x.to(tl.float32)
        return x.to(like.dtype)

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, M, N, eps,
        HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """out = RMSNorm(x + res) * w, rounded to out's dtype; res <- x + res (the new residual stream), one row
        per program. QUANT: out is not stored but quantized (`store_e4m3_groups`) into q [M_pad, N] and its scales,
        the grid is M_pad rows, and rows >= M store a zero row's codes and scales; out_ptr only names the dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = (cols < N) & (row < M)
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * N + cols, x, mask=mask)
            x = x.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = (w * y).to(out_ptr.dtype.element_ty)
        if QUANT:  # the stored value, read back as the unfused quantization reads it; pad rows +0 (no -0 codes)
            v = tl.where(mask, out.to(tl.float32), 0.0)
            store_e4m3_groups(v, q_ptr, s_ptr, row, 0, N, tl.num_programs(0), BLOCK, GROUP)
        else:
            tl.store(out_ptr + row * N + cols, out, mask=mask)

    @triton.jit
    def rope_kv_kernel(
        qkv_ptr, pos_ptr, wpos_ptr, slot_ptr, table_ptr, qn_ptr, kn_ptr, q_out_ptr, k_out_ptr, k_cache_ptr,
        v_cache_ptr, eps,
        H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr, QK_NORM: tl.constexpr,
        K_OUT: tl.constexpr, BLOCK_H: tl.constexpr, KV_MAX: tl.constexpr,
    ):  # fmt: skip
        """One row, all heads: q/k heads get (q/k-norm and) RoPE at position pos; k and v heads are written
        to the cache at position wpos (K_OUT: the rotated k heads also to k_out, in the model's dtype).

        qkv row layout [H q heads | KVH k heads | KVH v heads] x HD; the RoPE table row holds cos | sin
        with rotate_half's sign folded into sin, so rope(x) = x * cos + roll(x, HD/2) * sin.
        """
        b = tl.program_id(0).to(tl.int64)
        hh = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HD)[None, :]
        d_rolled = (d + HD // 2) % HD
        heads = hh < H + 2 * KVH
        is_q = hh < H
        is_k = (hh >= H) & (hh < H + KVH)
        is_v = (hh >= H + KVH) & heads
        base = qkv_ptr + b * (H + 2 * KVH) * HD + hh * HD
        x = tl.load(base + d, mask=heads, other=0.0).to(tl.float32)
        rolled = tl.load(base + d_rolled, mask=heads, other=0.0).to(tl.float32)
        if QK_NORM:  # per-head RMSNorm before RoPE (qwen3): rolled(norm(x)) = norm(x) at rolled places
            dt = q_out_ptr.dtype.element_ty
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]
            w = tl.where(is_q, tl.load(qn_ptr + d).to(tl.float32), tl.load(kn_ptr + d).to(tl.float32))
            w_r = tl.where(is_q, tl.load(qn_ptr + d_rolled).to(tl.float32), tl.load(kn_ptr + d_rolled).to(tl.float32))
            x_n = ((x * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            rolled_n = ((rolled * inv).to(dt).to(tl.float32) * w_r).to(dt).to(tl.float32)
            x = tl.where(is_v, x, x_n)
            rolled = tl.where(is_v, rolled, rolled_n)
        pos = tl.load(pos_ptr + b)
        wpos = tl.load(wpos_ptr + b)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        cos = tl.load(table_ptr + pos * 2 * HD + d).to(tl.float32)
        sin = tl.load(table_ptr + pos * 2 * HD + HD + d).to(tl.float32)
        y = (x * cos + rolled * sin).to(q_out_ptr.dtype.element_ty)
        tl.store(q_out_ptr + b * H * HD + hh * HD + d, y, mask=is_q)
        k_rows = ((slot * KVH + (hh - H)) * CAP + wpos) * HD + d
        tl.store(k_cache_ptr + k_rows, _to_cache(y, k_cache_ptr, KV_MAX), mask=is_k)
        if K_OUT:
            tl.store(k_out_ptr + (b * KVH + (hh - H)) * HD + d, y, mask=is_k)
        v_rows = ((slot * KVH + (hh - H - KVH)) * CAP + wpos) * HD + d
        tl.store(v_cache_ptr + v_rows, _to_cache(x, v_cache_ptr, KV_MAX), mask=is_v)

    @triton.jit
    def _attend(q, k_cache_ptr, v_cache_ptr, kv_base, s, length, m, l_sum, acc, scale_log2,
                HD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr,
                NUM_STAGES: tl.constexpr):  # fmt: skip
        """Online softmax (base 2) of the queries q [G, HD] over split s's cache positions at kv_base,
        [s x CHUNK, min((s + 1) x CHUNK, length)).

        PIPELINE: a `range` loop, which Triton software-pipelines (the next block's K/V loads are in flight
        while this block computes); the interpreter cannot `range` over a loaded bound, so it takes the
        equivalent while loop."""
        d = tl.arange(0, HD)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        if PIPELINE:
            for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                m, l_sum, acc = _attend_block(
                    q, k_cache_ptr, v_cache_ptr, kv_base, n0, end, d, m, l_sum, acc, scale_log2, HD, BLOCK_N
                )
        else:
            n0 = start
            while n0 < end:
                m, l_sum, acc = _attend_block(
                    q, k_cache_ptr, v_cache_ptr, kv_base, n0, end, d, m, l_sum, acc, scale_log2, HD, BLOCK_N
                )
                n0 += BLOCK_N
        return m, l_sum, acc

    @triton.jit
    def _attend_block(q, k_cache_ptr, v_cache_ptr, kv_base, n0, end, d, m, l_sum, acc, scale_log2,
                      HD: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        rows = kv_base + n[:, None] * HD + d[None, :]
        k = _from_cache(tl.load(k_cache_ptr + rows, mask=nmask[:, None], other=0.0), q)
        v = _from_cache(tl.load(v_cache_ptr + rows, mask=nmask[:, None], other=0.0), q)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # ieee: fp32 stays exact
        scores = tl.where(nmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return m_new, l_sum, acc

    @triton.jit
    def _attention_store(out_ptr, part_o_ptr, part_lse_ptr, b, heads, gmask, s, m, l_sum, acc,
                         H: tl.constexpr, HD: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
        """One split writes the output; several write partial outputs and log-sum-exps for the reduction."""
        d = tl.arange(0, HD)
        if SPLITS == 1:
            out = acc / l_sum[:, None]
            tl.store(
                out_ptr + b * H * HD + heads[:, None] * HD + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=gmask[:, None],
            )
        else:
            empty = l_sum == 0.0
            out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_sum)[:, None])
            lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l_sum)))
            row = (b * H + heads) * SPLITS + s
            tl.store(part_o_ptr + row[:, None] * HD + d[None, :], out, mask=gmask[:, None])
            tl.store(part_lse_ptr + row, lse, mask=gmask)

    @triton.jit
    def decode_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, scale_log2,
        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr,
        CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """One (row, kv head, split): the G query heads of the group attend to cache positions
        [split x CHUNK, min((split + 1) x CHUNK, len)) of the row's slot."""
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HD)
        gmask = g < G
        q = tl.load(q_ptr + b * H * HD + (kh * G + g)[:, None] * HD + d[None, :], mask=gmask[:, None], other=0.0)
        length = tl.load(lens_ptr + b)
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, HD), tl.float32)
        kv_base = (b * KVH + kh) * CAP * HD
        m, l_sum, acc = _attend(
            q, k_cache_ptr, v_cache_ptr, kv_base, s, length, m, l_sum, acc, scale_log2,
            HD, CHUNK, BLOCK_N, PIPELINE, NUM_STAGES,
        )  # fmt: skip
        _attention_store(out_ptr, part_o_ptr, part_lse_ptr, b, kh * G + g, gmask, s, m, l_sum, acc, H, HD, SPLITS)

    @triton.jit
    def rope_decode_attention_kernel(
        qkv_ptr, pos_ptr, lens_ptr, table_ptr, qn_ptr, kn_ptr, bias_ptr, k_cache_ptr, v_cache_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, scale_log2, eps,
        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr,
        CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        QK_NORM: tl.constexpr, PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr, KV_MAX: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        """`rope_kv_kernel` and `decode_attention_kernel` in one launch, for one new token per row.

        Each (row, kv head, split) applies (q-norm and) RoPE to its G query heads itself. The cached keys
        are the positions < min(pos, len); the new token's own key and value (k-norm + RoPE of its k head,
        its v head) enter the online softmax first, from registers, in the split whose chunk holds `pos`,
        which also writes them to the cache at `pos`; they enter as stored (an FP8 cache's rounding included),
        so this step sees the values every later step reads. Padded rows (pos = the scratch position, len = 1)
        write there and attend to one stale key: finite, and discarded by the caller.

        Every load that does not depend on another is issued up front (a decode step's attention is a
        chain of dependent loads at low occupancy: latency, not bandwidth, sets its time)."""
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        dt = qkv_ptr.dtype.element_ty  # the model's dtype (the cache's may be FP8)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HD)
        d_rolled = (d + HD // 2) % HD
        gmask = g < G
        pos = tl.load(pos_ptr + b)
        length = tl.minimum(tl.load(lens_ptr + b), pos)
        row = qkv_ptr + b * (H + 2 * KVH) * HD
        q_rows = row + (kh * G + g)[:, None] * HD
        x = tl.load(q_rows + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        rolled = tl.load(q_rows + d_rolled[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        k_row = row + (H + kh) * HD
        k = tl.load(k_row + d).to(tl.float32)
        k_rolled = tl.load(k_row + d_rolled).to(tl.float32)
        v = tl.load(row + (H + KVH + kh) * HD + d).to(tl.float32)
        if HAS_BIAS:  # qkv + bias, each rounded once to the model's dtype as torch's add rounds
            q_bias = bias_ptr + (kh * G + g)[:, None] * HD
            x = (x + tl.load(q_bias + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            rolled = rolled + tl.load(q_bias + d_rolled[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            rolled = rolled.to(dt).to(tl.float32)
            k_bias = bias_ptr + (H + kh) * HD
            k = (k + tl.load(k_bias + d).to(tl.float32)).to(dt).to(tl.float32)
            k_rolled = (k_rolled + tl.load(k_bias + d_rolled).to(tl.float32)).to(dt).to(tl.float32)
            v = (v + tl.load(bias_ptr + (H + KVH + kh) * HD + d).to(tl.float32)).to(dt).to(tl.float32)
        cos = tl.load(table_ptr + pos * 2 * HD + d).to(tl.float32)
        sin = tl.load(table_ptr + pos * 2 * HD + HD + d).to(tl.float32)
        if QK_NORM:  # per-head RMSNorm before RoPE (qwen3), rounded as the unfused kernel rounds
            qn = tl.load(qn_ptr + d).to(tl.float32)[None, :]
            qn_r = tl.load(qn_ptr + d_rolled).to(tl.float32)[None, :]
            kn = tl.load(kn_ptr + d).to(tl.float32)
            kn_r = tl.load(kn_ptr + d_rolled).to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]
            x = ((x * inv).to(dt).to(tl.float32) * qn).to(dt).to(tl.float32)
            rolled = ((rolled * inv).to(dt).to(tl.float32) * qn_r).to(dt).to(tl.float32)
            inv_k = tl.rsqrt(tl.sum(k * k, axis=0) / HD + eps)
            k = ((k * inv_k).to(dt).to(tl.float32) * kn).to(dt).to(tl.float32)
            k_rolled = ((k_rolled * inv_k).to(dt).to(tl.float32) * kn_r).to(dt).to(tl.float32)
        q = (x * cos[None, :] + rolled * sin[None, :]).to(dt)
        k = (k * cos + k_rolled * sin).to(dt)
        kv_base = (b * KVH + kh) * CAP * HD
        k = _to_cache(k, k_cache_ptr, KV_MAX)
        v = _to_cache(v.to(dt), v_cache_ptr, KV_MAX)
        owner = tl.minimum(pos // CHUNK, SPLITS - 1) == s  # this split holds the new token
        tl.store(k_cache_ptr + kv_base + pos * HD + d, k, mask=owner & (d < HD))
        tl.store(v_cache_ptr + kv_base + pos * HD + d, v, mask=owner & (d < HD))
        score = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2
        m = tl.where(owner, score, float("-inf"))
        l_sum = tl.where(owner, 1.0, 0.0) + tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.where(owner, v.to(tl.float32)[None, :], 0.0) + tl.zeros((BLOCK_G, HD), tl.float32)
        m, l_sum, acc = _attend(
            q, k_cache_ptr, v_cache_ptr, kv_base, s, length, m, l_sum, acc, scale_log2,
            HD, CHUNK, BLOCK_N, PIPELINE, NUM_STAGES,
        )  # fmt: skip
        _attention_store(out_ptr, part_o_ptr, part_lse_ptr, b, kh * G + g, gmask, s, m, l_sum, acc, H, HD, SPLITS)

    @triton.jit
    def attention_reduce_kernel(
        part_o_ptr, part_lse_ptr, out_ptr, HD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr
    ):
        """Combine the splits of one (row, head): weights 2^(lse_s - max lse)."""
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, HD)
        smask = sp < SPLITS
        lse = tl.load(part_lse_ptr + bh * SPLITS + sp, mask=smask, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, axis=0))
        o = tl.load(part_o_ptr + (bh * SPLITS + sp)[:, None] * HD + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + bh * HD + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(
        gate_up_ptr, out_ptr, q_ptr, s_ptr, M, N, QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr
    ):
        """out[b] = silu(gate_up[b, :N]) * gate_up[b, N:], rounded to out's dtype. QUANT: quantized as the norm's
        (`add_rms_norm_kernel`) instead of stored, over a grid of M_pad rows (BLOCK a multiple of GROUP)."""
        b = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BLOCK
        cols = first + tl.arange(0, BLOCK)
        mask = (cols < N) & (b < M)
        gate = tl.load(gate_up_ptr + b * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + b * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = (act * up).to(out_ptr.dtype.element_ty)
        if QUANT:
            v = tl.where(mask, out.to(tl.float32), 0.0)
            store_e4m3_groups(v, q_ptr, s_ptr, b, first, N, tl.num_programs(0), BLOCK, GROUP)
        else:
            tl.store(out_ptr + b * N + cols, out, mask=mask)

    @triton.jit
    def sample_stats_kernel(
        logits_ptr, inv_temp_ptr, m_ptr, s_ptr, V: tl.constexpr, CH: tl.constexpr, C: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One (row, chunk of CH logits): max m and sum of exp(x - m) of x = logits / T."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        total = 0.0
        for i in range(0, CH // BLOCK):
            idx = c * CH + i * BLOCK + cols
            x = tl.load(logits_ptr + row * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, axis=0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        tl.store(m_ptr + row * C + c, m)
        tl.store(s_ptr + row * C + c, total)

    @triton.jit
    def sample_pick_kernel(
        logits_ptr, inv_temp_ptr, u_ptr, greedy_ptr, m_ptr, s_ptr, tokens_ptr, logprobs_ptr,
        V: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row: log-sum-exp from the chunk stats; greedy rows take the first argmax (the first index
        equal to the max, in the first chunk whose max it is); sampled rows find the chunk where the
        running mass first exceeds u x total, then the token inside it. Either way one chunk is read."""
        row = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, BLOCK_C)
        cmask = cs < C
        m = tl.load(m_ptr + row * C + cs, mask=cmask, other=float("-inf"))
        s = tl.load(s_ptr + row * C + cs, mask=cmask, other=0.0)
        big = tl.max(m, axis=0)
        lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
        inv_t = tl.load(inv_temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        if tl.load(greedy_ptr + row) != 0.0:
            chunk = tl.min(tl.where(m == big, cs, C), axis=0)
            token = chunk * CH
            found = V
            for i in range(0, CH // BLOCK):
                idx = chunk * CH + i * BLOCK + cols
                x = tl.load(logits_ptr + row * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
                found = tl.minimum(found, tl.min(tl.where((x == big) & (idx < V), idx, V), axis=0))
            token = tl.where(found < V, found, token)
        else:
            mass = tl.where(cmask, s * tl.exp(m - lse), 0.0)  # each chunk's probability mass
            cum = tl.cumsum(mass, axis=0)
            target = tl.load(u_ptr + row) * tl.sum(mass, axis=0)
            chunk = tl.min(tl.where((cum > target) & cmask, cs, C), axis=0)
            chunk = tl.where(chunk < C, chunk, tl.max(tl.where(mass > 0.0, cs, 0), axis=0))  # rounding past the end
            run = tl.sum(tl.where(cs < chunk, mass, 0.0), axis=0)
            found = V
            last_nonzero = chunk * CH
            for i in range(0, CH // BLOCK):
                idx = chunk * CH + i * BLOCK + cols
                valid = idx < V
                x = tl.load(logits_ptr + row * V + idx, mask=valid, other=0.0).to(tl.float32) * inv_t
                p = tl.where(valid, tl.exp(x - lse), 0.0)
                c = tl.cumsum(p, axis=0) + run
                found = tl.minimum(found, tl.min(tl.where((c > target) & valid, idx, V), axis=0))
                last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(p > 0.0, idx, 0), axis=0))
                run += tl.sum(p, axis=0)
            token = tl.where(found < V, found, last_nonzero)  # the chunk's rounded mass fell short: its last token
        x_tok = tl.load(logits_ptr + row * V + token).to(tl.float32) * inv_t
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, x_tok - lse)
