"""Triton kernels for the embedded engine's GPU decode step, prefill and sampler.

A decode step of a small model at a large batch is bound by the number of kernels, not by bandwidth:
the eager layer is ~27 kernels (norms, RoPE pieces, index writes, masks, residual adds). These kernels
bring a dense layer to nine launches: add+RMSNorm, the qkv GEMM, one kernel for RoPE (+ q/k-norm), the
KV write and decode attention over each row's own length (plus a reduction when the keys are split),
the o GEMM, add+RMSNorm, the gate/up GEMM, SiLU*up, the down GEMM. GEMMs stay with cuBLAS (Triton
GEMMs tried at the decode shapes were no faster). A prefill uses the norm, RoPE + KV-write and SiLU
kernels over all its tokens.

Numerics: each kernel computes in fp32 and rounds once on store, where the eager path rounds after
every bf16 op, so bf16 results differ in the last bits (fp32 agrees to rounding). The sampler kernel
implements the same inverse-CDF rule as `sampler._inverse_cdf` (first index whose running mass exceeds
u x total), in two passes over the logits instead of five.

Everything here also runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is how
the tests check it where there is no GPU. `available()` says whether the kernels can be used at all.
"""

from __future__ import annotations

import functools
import math
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


def supports(spec) -> bool:
    """Shapes the decode kernels handle: power-of-two head_dim >= 16, dense MLP."""
    hd = spec.head_dim
    return hd >= 16 and hd & (hd - 1) == 0 and not spec.moe_layers and spec.num_heads % spec.num_kv_heads == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """out = RMSNorm(x + res) * w; res <- x + res (the new residual stream), one row per program."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * N + cols, x, mask=mask)
            x = x.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, pos_ptr, wpos_ptr, slot_ptr, table_ptr, qn_ptr, kn_ptr, q_out_ptr, k_out_ptr, k_cache_ptr,
        v_cache_ptr, eps,
        H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr, QK_NORM: tl.constexpr,
        K_OUT: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """One row, all heads: q/k heads get (q/k-norm and) RoPE at position pos; k and v heads are written
        to the cache at position wpos (K_OUT: the rotated k heads also to k_out).

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
        tl.store(k_cache_ptr + ((slot * KVH + (hh - H)) * CAP + wpos) * HD + d, y, mask=is_k)
        if K_OUT:
            tl.store(k_out_ptr + (b * KVH + (hh - H)) * HD + d, y, mask=is_k)
        v_rows = ((slot * KVH + (hh - H - KVH)) * CAP + wpos) * HD + d
        tl.store(v_cache_ptr + v_rows, x.to(v_cache_ptr.dtype.element_ty), mask=is_v)

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
        k = tl.load(k_cache_ptr + kv_base + n[:, None] * HD + d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_base + n[:, None] * HD + d[None, :], mask=nmask[:, None], other=0.0)
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
    def _decode_attention_kernel(
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
    def _rope_decode_attention_kernel(
        qkv_ptr, pos_ptr, lens_ptr, table_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, scale_log2, eps,
        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr,
        CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        QK_NORM: tl.constexpr, PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """`_rope_kv_kernel` and `_decode_attention_kernel` in one launch, for one new token per row.

        Each (row, kv head, split) applies (q-norm and) RoPE to its G query heads itself. The cached keys
        are the positions < min(pos, len); the new token's own key and value (k-norm + RoPE of its k head,
        its v head) enter the online softmax first, from registers, in the split whose chunk holds `pos`,
        which also writes them to the cache at `pos`. Padded rows (pos = the scratch position, len = 1)
        write there and attend to one stale key: finite, and discarded by the caller.

        Every load that does not depend on another is issued up front (a decode step's attention is a
        chain of dependent loads at low occupancy: latency, not bandwidth, sets its time)."""
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        dt = k_cache_ptr.dtype.element_ty
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
        owner = tl.minimum(pos // CHUNK, SPLITS - 1) == s  # this split holds the new token
        tl.store(k_cache_ptr + kv_base + pos * HD + d, k, mask=owner & (d < HD))
        tl.store(v_cache_ptr + kv_base + pos * HD + d, v.to(dt), mask=owner & (d < HD))
        score = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2
        m = tl.where(owner, score, float("-inf"))
        l_sum = tl.where(owner, 1.0, 0.0) + tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.where(owner, v.to(dt).to(tl.float32)[None, :], 0.0) + tl.zeros((BLOCK_G, HD), tl.float32)
        m, l_sum, acc = _attend(
            q, k_cache_ptr, v_cache_ptr, kv_base, s, length, m, l_sum, acc, scale_log2,
            HD, CHUNK, BLOCK_N, PIPELINE, NUM_STAGES,
        )  # fmt: skip
        _attention_store(out_ptr, part_o_ptr, part_lse_ptr, b, kh * G + g, gmask, s, m, l_sum, acc, H, HD, SPLITS)

    @triton.jit
    def _attention_reduce_kernel(
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
    def _silu_mul_kernel(gate_up_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """out[b] = silu(gate_up[b, :N]) * gate_up[b, N:]."""
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(gate_up_ptr + b * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + b * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + b * N + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sample_stats_kernel(
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
    def _sample_pick_kernel(
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


# ---- host wrappers ---------------------------------------------------------------------------------

# The kernels index every tensor as dense row-major memory (`ptr + row * width + col`). Inputs pass
# through `_dense` (a no-op when already dense): an expanded or strided view, such as the slots of a
# one-request prefill `slot[:, None].expand(1, T).reshape(-1)` (stride 0, one element of storage), would
# otherwise be read past its storage. Tensors written in place (caches, residuals) must already be dense.


def _dense(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _check_dense(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous for the Triton kernels (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); it is written in place"
            )


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out=None):
    """RMSNorm(x + residual) * weight over the last dim; `residual` (if given) becomes x + residual."""
    n = x.shape[-1]
    rows = x.numel() // n
    (x, weight) = _dense(x, weight)
    _check_dense(residual=residual, out=out)
    out = torch.empty_like(x) if out is None else out
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, n, eps,
        HAS_RES=residual is not None, BLOCK=_next_pow2(n),
    )  # fmt: skip
    return out


def rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rope_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,
    write_positions: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE (after q/k-norm if given) of one token per row; k/v go to cache[slot, :, position]; returns q.

    qkv [B, (H + 2 KVH) x HD]; positions, slots [B] int; caches [slots, KVH, CAP, HD] (one layer).
    write_positions [B]: cache positions to write at instead of `positions` (a prefill's padding goes to
    the scratch position); k_out [B, KVH, HD]: also receives the rotated keys."""
    b = qkv.shape[0]
    hd = k_cache.shape[-1]
    qkv, positions, slots, rope_table, q_norm, k_norm, write_positions = _dense(
        qkv, positions, slots, rope_table, q_norm, k_norm, write_positions
    )
    _check_dense(k_cache=k_cache, v_cache=v_cache, q_out=q_out, k_out=k_out)
    q_out = torch.empty((b, num_heads, hd), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    qk_norm = q_norm is not None
    _rope_kv_kernel[(b,)](
        qkv, positions, positions if write_positions is None else write_positions, slots, rope_table,
        q_norm if qk_norm else qkv, k_norm if qk_norm else qkv,
        q_out, q_out if k_out is None else k_out, k_cache, v_cache, eps,
        H=num_heads, KVH=num_kv_heads, HD=hd, CAP=k_cache.shape[2], QK_NORM=qk_norm, K_OUT=k_out is not None,
        BLOCK_H=_next_pow2(num_heads + 2 * num_kv_heads),
    )  # fmt: skip
    return q_out


class DecodeAttention:
    """Decode attention of one query token per row over its slot's first `lens[row]` cache positions.

    The number of key splits is fixed per batch size (CUDA-graph friendly): enough (row, kv head,
    split) programs to fill the device `programs_per_sm` times over, each split a fixed chunk of the
    cache capacity; splits past a row's length exit at once. `rope_attend` also does the RoPE and the
    cache write of the step's new token (one launch instead of two); `__call__` takes ready queries.
    """

    BLOCK_N = 64

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        num_sms: int,
        *,
        programs_per_sm: int = 2,
        blocks_per_split: int = 4,
        num_warps: int = 4,
        num_stages: int = 2,
    ):
        self.h, self.kvh, self.hd, self.cap = num_heads, num_kv_heads, head_dim, capacity
        self.group = num_heads // num_kv_heads
        self.num_sms = num_sms
        self.programs_per_sm, self.blocks_per_split = programs_per_sm, blocks_per_split
        self.num_warps, self.num_stages = num_warps, num_stages
        self.scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634  # log2(e): softmax in base 2

    def splits(self, batch: int) -> int:
        """Key splits per (row, kv head): programs_per_sm x SMs programs in all, each split at least
        blocks_per_split key blocks of the capacity."""
        most = max(1, self.cap // (self.blocks_per_split * self.BLOCK_N))
        want = -(-self.programs_per_sm * self.num_sms // (batch * self.kvh))
        return min(_next_pow2(want), 1 << (most.bit_length() - 1))

    def _launch(self, kernel, b: int, device: torch.device, out: torch.Tensor, args: tuple, **meta) -> None:
        splits = self.splits(b)
        chunk = -(-self.cap // splits)
        chunk = -(-chunk // self.BLOCK_N) * self.BLOCK_N
        if splits > 1:
            part_o = torch.empty((b, self.h, splits, self.hd), dtype=torch.float32, device=device)
            part_lse = torch.empty((b, self.h, splits), dtype=torch.float32, device=device)
        else:
            part_o = part_lse = out
        kernel[(b, self.kvh, splits)](
            *args, out, part_o, part_lse, self.scale_log2, *meta.pop("scalars", ()),
            H=self.h, KVH=self.kvh, G=self.group, HD=self.hd, CAP=self.cap, CHUNK=chunk, SPLITS=splits,
            BLOCK_G=max(16, _next_pow2(self.group)), BLOCK_N=self.BLOCK_N, PIPELINE=not INTERPRET,
            NUM_STAGES=self.num_stages, num_warps=self.num_warps, **meta,
        )  # fmt: skip
        if splits > 1:
            _attention_reduce_kernel[(b * self.h,)](
                part_o, part_lse, out, HD=self.hd, SPLITS=splits, BLOCK_S=max(2, _next_pow2(splits))
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor, out=None
    ) -> torch.Tensor:
        """q [B, H, HD]; caches [slots >= B, KVH, CAP, HD] (row b reads slot b); returns [B, H, HD]."""
        q, lens = _dense(q, lens)
        _check_dense(k_cache=k_cache, v_cache=v_cache, out=out)
        out = torch.empty_like(q) if out is None else out
        self._launch(_decode_attention_kernel, q.shape[0], q.device, out, (q, k_cache, v_cache, lens))
        return out

    def rope_attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        lens: torch.Tensor,
        rope_table: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> torch.Tensor:
        """The step's token of each row: RoPE (after q/k-norm if given) of its q and k heads, its k and v
        written to cache[row, :, positions[row]], then attention over the positions < lens[row] (the
        cached ones before it and itself). qkv [B, (H + 2 KVH) x HD]; returns [B, H, HD]."""
        b = qkv.shape[0]
        qkv, positions, lens, rope_table, q_norm, k_norm = _dense(qkv, positions, lens, rope_table, q_norm, k_norm)
        _check_dense(k_cache=k_cache, v_cache=v_cache)
        out = torch.empty((b, self.h, self.hd), dtype=qkv.dtype, device=qkv.device)
        qk_norm = q_norm is not None
        args = (
            qkv, positions, lens, rope_table,
            q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, k_cache, v_cache,
        )  # fmt: skip
        self._launch(_rope_decode_attention_kernel, b, qkv.device, out, args, scalars=(eps,), QK_NORM=qk_norm)
        return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [B, 2N] -> [B, N]."""
    b, n2 = gate_up.shape
    n = n2 // 2
    (gate_up,) = _dense(gate_up)
    _check_dense(out=out)
    out = torch.empty((b, n), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    block = min(1024, _next_pow2(n))
    _silu_mul_kernel[(b, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


def sample_rows(
    logits: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [B, V] (fp32 or bf16): a token and its log-prob under log_softmax(logits x inv_temp).

    Sampled rows take the inverse-CDF token of uniform u; greedy rows (greedy != 0) the first argmax.
    Two kernels: per-chunk statistics over (row, chunk) programs, then one program per row that
    reads only the chunk its token falls in."""
    b, v = logits.shape
    logits, inv_temp, u, greedy = _dense(logits, inv_temp, u, greedy)
    block, ch, c = _sample_chunking(v)
    stats = torch.empty((2, b, c), dtype=torch.float32, device=logits.device)
    _sample_stats_kernel[(b, c)](logits, inv_temp, stats[0], stats[1], V=v, CH=ch, C=c, BLOCK=block)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(b,)](
        logits, inv_temp, u, greedy, stats[0], stats[1], tokens, logprobs,
        V=v, CH=ch, C=c, BLOCK_C=max(2, _next_pow2(c)), BLOCK=block,
    )  # fmt: skip
    return tokens, logprobs


SAMPLE_BLOCK, SAMPLE_MAX_CHUNKS = 4096, 64  # H200, vocab 152K, batch 256: 36 us (1024 / 32: 47 us)


@functools.cache
def _sample_chunking(v: int) -> tuple[int, int, int]:
    """(BLOCK, chunk length CH, chunks C) for a vocabulary of v: up to SAMPLE_MAX_CHUNKS chunks of whole blocks."""
    block = min(SAMPLE_BLOCK if not INTERPRET else 64, _next_pow2(v))
    blocks = -(-v // block)
    per_chunk = -(-blocks // SAMPLE_MAX_CHUNKS)
    return block, per_chunk * block, -(-blocks // per_chunk)
