"""Triton kernels for the embedded engine's GPU decode step and sampler.

A decode step of a small model at a large batch is bound by the number of kernels, not by bandwidth:
the eager layer is ~27 kernels (norms, RoPE pieces, index writes, masks, residual adds). These kernels
bring a dense layer to ten launches: add+RMSNorm, the qkv GEMM, RoPE (+ q/k-norm) fused with the KV
write, decode attention over each row's own length (plus a reduction when the keys are split), the
o GEMM, add+RMSNorm, the gate/up GEMM, SiLU*up, the down GEMM. GEMMs stay with cuBLAS.

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
        qkv_ptr, pos_ptr, slot_ptr, table_ptr, qn_ptr, kn_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, eps,
        H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, CAP: tl.constexpr, QK_NORM: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """One row, all heads: q/k heads get (q/k-norm and) RoPE; k and v heads are written to the cache.

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
        slot = tl.load(slot_ptr + b).to(tl.int64)
        cos = tl.load(table_ptr + pos * 2 * HD + d).to(tl.float32)
        sin = tl.load(table_ptr + pos * 2 * HD + HD + d).to(tl.float32)
        y = (x * cos + rolled * sin).to(q_out_ptr.dtype.element_ty)
        tl.store(q_out_ptr + b * H * HD + hh * HD + d, y, mask=is_q)
        tl.store(k_cache_ptr + ((slot * KVH + (hh - H)) * CAP + pos) * HD + d, y, mask=is_k)
        v_rows = ((slot * KVH + (hh - H - KVH)) * CAP + pos) * HD + d
        tl.store(v_cache_ptr + v_rows, x.to(v_cache_ptr.dtype.element_ty), mask=is_v)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        lens_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        scale_log2,
        H: tl.constexpr,
        KVH: tl.constexpr,
        G: tl.constexpr,
        HD: tl.constexpr,
        CAP: tl.constexpr,
        CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One (row, kv head, split): the G query heads of the group attend to cache positions
        [split x CHUNK, min((split + 1) x CHUNK, len)) of the row's slot with an online softmax (base 2).
        One split writes the output; several write partial outputs and log-sum-exps for the reduction."""
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HD)
        gmask = g < G
        q = tl.load(q_ptr + b * H * HD + (kh * G + g)[:, None] * HD + d[None, :], mask=gmask[:, None], other=0.0)
        length = tl.load(lens_ptr + b)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, length)
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, HD), tl.float32)
        kv_base = (b * KVH + kh) * CAP * HD
        n0 = start
        while n0 < end:  # a while loop: its bound is loaded, which Triton's interpreter cannot range() over
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            k = tl.load(k_cache_ptr + kv_base + n[:, None] * HD + d[None, :], mask=nmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # ieee: fp32 stays exact
            scores = tl.where(nmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_base + n[:, None] * HD + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = m_new
            n0 += BLOCK_N
        heads = kh * G + g
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
        logits_ptr, inv_temp_ptr, m_ptr, s_ptr, arg_ptr,
        V: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One (row, chunk of CH logits): max m, sum of exp(x - m) and first argmax of x = logits / T."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        total = 0.0
        arg = 0
        for i in range(0, CH // BLOCK):
            idx = c * CH + i * BLOCK + cols
            x = tl.load(logits_ptr + row * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            bmax = tl.max(x, axis=0)
            arg = tl.where(bmax > m, tl.argmax(x, axis=0) + c * CH + i * BLOCK, arg)
            m_new = tl.maximum(m, bmax)
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        tl.store(m_ptr + row * C + c, m)
        tl.store(s_ptr + row * C + c, total)
        tl.store(arg_ptr + row * C + c, arg)

    @triton.jit
    def _sample_pick_kernel(
        logits_ptr, inv_temp_ptr, u_ptr, greedy_ptr, m_ptr, s_ptr, arg_ptr, tokens_ptr, logprobs_ptr,
        V: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row: log-sum-exp from the chunk stats; greedy rows take the first argmax; sampled rows find
        the chunk where the running mass first exceeds u x total, then the token inside it."""
        row = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, BLOCK_C)
        cmask = cs < C
        m = tl.load(m_ptr + row * C + cs, mask=cmask, other=float("-inf"))
        s = tl.load(s_ptr + row * C + cs, mask=cmask, other=0.0)
        big = tl.max(m, axis=0)
        lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
        first_max = tl.min(tl.where(m == big, cs, C), axis=0)
        token = tl.load(arg_ptr + row * C + first_max)
        inv_t = tl.load(inv_temp_ptr + row)
        if tl.load(greedy_ptr + row) == 0.0:
            mass = tl.where(cmask, s * tl.exp(m - lse), 0.0)  # each chunk's probability mass
            cum = tl.cumsum(mass, axis=0)
            target = tl.load(u_ptr + row) * tl.sum(mass, axis=0)
            chunk = tl.min(tl.where((cum > target) & cmask, cs, C), axis=0)
            chunk = tl.where(chunk < C, chunk, tl.max(tl.where(mass > 0.0, cs, 0), axis=0))  # rounding past the end
            run = tl.sum(tl.where(cs < chunk, mass, 0.0), axis=0)
            cols = tl.arange(0, BLOCK)
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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out=None):
    """RMSNorm(x + residual) * weight over the last dim; `residual` (if given) becomes x + residual."""
    n = x.shape[-1]
    rows = x.numel() // n
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
) -> torch.Tensor:
    """RoPE (after q/k-norm if given) of one token per row; k/v go to cache[slot, :, position]; returns q.

    qkv [B, (H + 2 KVH) x HD]; positions, slots [B] int; caches [slots, KVH, CAP, HD] (one layer)."""
    b = qkv.shape[0]
    hd = k_cache.shape[-1]
    q_out = torch.empty((b, num_heads, hd), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    qk_norm = q_norm is not None
    _rope_kv_kernel[(b,)](
        qkv, positions, slots, rope_table,
        q_norm if qk_norm else qkv, k_norm if qk_norm else qkv,
        q_out, k_cache, v_cache, eps,
        H=num_heads, KVH=num_kv_heads, HD=hd, CAP=k_cache.shape[2], QK_NORM=qk_norm,
        BLOCK_H=_next_pow2(num_heads + 2 * num_kv_heads),
    )  # fmt: skip
    return q_out


class DecodeAttention:
    """Decode attention of one query token per row over its slot's first `lens[row]` cache positions.

    The number of key splits is fixed per batch size (CUDA-graph friendly): enough (row, kv head,
    split) programs to fill the device twice over, each split a fixed chunk of the cache capacity;
    splits past a row's length exit at once.
    """

    BLOCK_N = 64

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, capacity: int, num_sms: int):
        self.h, self.kvh, self.hd, self.cap = num_heads, num_kv_heads, head_dim, capacity
        self.group = num_heads // num_kv_heads
        self.num_sms = num_sms
        self.scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634  # log2(e): softmax in base 2

    def splits(self, batch: int) -> int:
        """Key splits per (row, kv head): 2 x SMs programs in all, each split >= 4 key blocks."""
        most = max(1, self.cap // (4 * self.BLOCK_N))
        want = -(-2 * self.num_sms // (batch * self.kvh))
        return min(_next_pow2(want), 1 << (most.bit_length() - 1))

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor, out=None
    ) -> torch.Tensor:
        b = q.shape[0]
        out = torch.empty_like(q) if out is None else out
        splits = self.splits(b)
        chunk = -(-self.cap // splits)
        chunk = -(-chunk // self.BLOCK_N) * self.BLOCK_N
        if splits > 1:
            part_o = torch.empty((b, self.h, splits, self.hd), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((b, self.h, splits), dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out
        _decode_attention_kernel[(b, self.kvh, splits)](
            q, k_cache, v_cache, lens, out, part_o, part_lse, self.scale_log2,
            H=self.h, KVH=self.kvh, G=self.group, HD=self.hd, CAP=self.cap, CHUNK=chunk, SPLITS=splits,
            BLOCK_G=max(16, _next_pow2(self.group)), BLOCK_N=self.BLOCK_N,
        )  # fmt: skip
        if splits > 1:
            _attention_reduce_kernel[(b * self.h,)](
                part_o, part_lse, out, HD=self.hd, SPLITS=splits, BLOCK_S=max(2, _next_pow2(splits))
            )
        return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [B, 2N] -> [B, N]."""
    b, n2 = gate_up.shape
    n = n2 // 2
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
    block, ch, c = _sample_chunking(v)
    stats = torch.empty((2, b, c), dtype=torch.float32, device=logits.device)
    args = torch.empty((b, c), dtype=torch.int32, device=logits.device)
    _sample_stats_kernel[(b, c)](logits, inv_temp, stats[0], stats[1], args, V=v, CH=ch, C=c, BLOCK=block)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(b,)](
        logits, inv_temp, u, greedy, stats[0], stats[1], args, tokens, logprobs,
        V=v, CH=ch, C=c, BLOCK_C=max(2, _next_pow2(c)), BLOCK=block,
    )  # fmt: skip
    return tokens, logprobs


@functools.cache
def _sample_chunking(v: int) -> tuple[int, int, int]:
    """(BLOCK, chunk length CH, chunks C) for a vocabulary of v: up to 32 chunks of whole blocks."""
    block = min(1024 if not INTERPRET else 64, _next_pow2(v))
    blocks = -(-v // block)
    per_chunk = -(-blocks // 32)
    return block, per_chunk * block, -(-blocks // per_chunk)
