"""Triton kernels for the embedded engine's GPU decode step, prefill and sampler: the host launchers.

The kernels themselves are in triton_kernels.py; this module sizes their grids and blocks, checks their
inputs and allocates their outputs.

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

FP8 serving: the norm and SiLU kernels can hand the next GEMM its input already quantized (`quantize=True`:
an fp8.QuantizedInput, the codes and scales fp8_triton.quantize_activation would give for the output they
would have stored), which spares that GEMM its own quantization launch where cuBLASLt runs it.

Everything here also runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is how
the tests check it where there is no GPU. `available()` says whether the kernels can be used at all.
"""

from __future__ import annotations

import functools
import math

import torch

from miles.engines.embedded import fp8
from miles.engines.embedded import triton_kernels as kernels
from miles.engines.embedded.kv_cache import is_fp8
from miles.engines.embedded.triton_kernels import INTERPRET, triton
from miles.engines.embedded.triton_kernels import available as available  # where the engine asks it


def converts_e4m3(device: torch.device) -> bool:
    """Whether the kernels can store and load an e4m3 KV cache on `device`: Triton converts e4m3 on compute
    capability 8.9 and later (and in the interpreter); e5m2 everywhere."""
    return INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def supports(spec) -> bool:
    """Shapes the decode kernels handle: power-of-two head_dim >= 16, dense MLP."""
    hd = spec.head_dim
    return hd >= 16 and hd & (hd - 1) == 0 and not spec.moe_layers and spec.num_heads % spec.num_kv_heads == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---- host wrappers ---------------------------------------------------------------------------------

# The kernels index every tensor as dense row-major memory (`ptr + row * width + col`). Inputs pass
# through `_dense` (a no-op when already dense): an expanded or strided view, such as the slots of a
# one-request prefill `slot[:, None].expand(1, T).reshape(-1)` (stride 0, one element of storage), would
# otherwise be read past its storage. Tensors written in place (caches, residuals) must already be dense.


def _dense(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _kv_max(cache: torch.Tensor) -> float:
    """The kernels' KV_MAX: an FP8 cache's largest finite value, what its writes saturate at (0.0: no clamp)."""
    return torch.finfo(cache.dtype).max if is_fp8(cache.dtype) else 0.0


def _check_dense(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous for the Triton kernels (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); it is written in place"
            )


# The norm's and SiLU's launch settings (Triton's defaults: 4 warps; a SiLU program takes 1024 columns)
NORM_WARPS = 4
SILU_BLOCK, SILU_WARPS = 1024, 4


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    quantize: bool = False,
    num_warps: int = NORM_WARPS,
) -> torch.Tensor | fp8.QuantizedInput:
    """RMSNorm(x + residual) * weight over the last dim, in the weight's dtype; `residual` (if given) becomes
    x + residual, kept in its own dtype (an fp32 stream under bf16 GEMM outputs, or `x` itself fp32).
    quantize: return the output as the FP8 GEMM's quantized input instead (`_quantized_output`). num_warps: one
    row's program (`bench/elementwise_kernels.py` sweeps it)."""
    n = x.shape[-1]
    rows = x.numel() // n
    (x, weight) = _dense(x, weight)
    _check_dense(residual=residual, out=out)
    if quantize:
        qi = _quantized_output(rows, n, weight.dtype, x.device, out)
        grid_rows, out, q, scales = qi.q.shape[0], weight, qi.q, qi.scales  # out: the weight names the dtype alone
    else:
        out = torch.empty_like(x, dtype=weight.dtype) if out is None else out
        grid_rows, q, scales = rows, out, out
    kernels.add_rms_norm_kernel[(grid_rows,)](
        x, residual if residual is not None else x, weight, out, q, scales, rows, n, eps,
        HAS_RES=residual is not None, QUANT=quantize, BLOCK=_next_pow2(n), GROUP=fp8.BLOCK, num_warps=num_warps,
    )  # fmt: skip
    return qi if quantize else out


def _quantized_output(
    rows: int, width: int, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None
) -> fp8.QuantizedInput:
    """Room for a kernel's [rows, width] output (model dtype `dtype`) stored as its e4m3 quantization, in the
    layout `fp8_triton.quantize_activation(output, pad_to=fp8.ROWS_MULTIPLE)` writes and with its codes: rows
    padded to fp8.ROWS_MULTIPLE (pad rows: zero codes), scales outer-dim-major. What an FP8 GEMM on cuBLASLt (or
    Triton's) takes as is (fp8.takes_quantized_input); the kernel quantizes the value it would have stored, rounded
    to `dtype`."""
    if out is not None:
        raise ValueError("quantize=True returns its own codes and scales; pass out=None")
    if width % fp8.BLOCK:
        raise ValueError(f"a quantized output needs whole groups of {fp8.BLOCK} channels; width is {width}")
    m_pad = -(-rows // fp8.ROWS_MULTIPLE) * fp8.ROWS_MULTIPLE
    q = torch.empty((m_pad, width), dtype=fp8.E4M3, device=device)
    scales = torch.empty((width // fp8.BLOCK, m_pad), dtype=torch.float32, device=device).t()
    return fp8.QuantizedInput(q, scales, rows, dtype)


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
    the scratch position); k_out [B, KVH, HD]: also receives the rotated keys (in qkv's dtype, whatever the
    cache's: an FP8 cache's writes saturate, kv_cache.py)."""
    b = qkv.shape[0]
    hd = k_cache.shape[-1]
    qkv, positions, slots, rope_table, q_norm, k_norm, write_positions = _dense(
        qkv, positions, slots, rope_table, q_norm, k_norm, write_positions
    )
    _check_dense(k_cache=k_cache, v_cache=v_cache, q_out=q_out, k_out=k_out)
    q_out = torch.empty((b, num_heads, hd), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    qk_norm = q_norm is not None
    kernels.rope_kv_kernel[(b,)](
        qkv, positions, positions if write_positions is None else write_positions, slots, rope_table,
        q_norm if qk_norm else qkv, k_norm if qk_norm else qkv,
        q_out, q_out if k_out is None else k_out, k_cache, v_cache, eps,
        H=num_heads, KVH=num_kv_heads, HD=hd, CAP=k_cache.shape[2], QK_NORM=qk_norm, K_OUT=k_out is not None,
        BLOCK_H=_next_pow2(num_heads + 2 * num_kv_heads), KV_MAX=_kv_max(k_cache),
    )  # fmt: skip
    return q_out


def attention_settings(cache_dtype: torch.dtype) -> dict[str, int]:
    """The decode attention's launch settings for a cache stored in `cache_dtype`, beyond DecodeAttention's
    defaults. An FP8 cache's key blocks are half the bytes, so a third pipeline stage keeps as many in flight:
    `bench/decode_attention.py --kv-cache-dtype fp8_e4m3` at the 7B shape on an H100 measured 34.3 us a call
    against 36.8 with two (a bf16 cache is fastest with two: the 0.5B sweep in bench/results)."""
    return {"num_stages": 3} if is_fp8(cache_dtype) else {}


class DecodeAttention:
    """Decode attention of one query token per row over its slot's first `lens[row]` cache positions.

    The number of key splits is fixed per batch size (CUDA-graph friendly): enough (row, kv head,
    split) programs to fill the device `programs_per_sm` times over, each split a fixed chunk of the
    cache capacity; splits past a row's length exit at once. `rope_attend` also does the RoPE and the
    cache write of the step's new token (one launch instead of two); `__call__` takes ready queries.
    """

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
        block_n: int = 64,
    ):
        """The launch settings (programs_per_sm, blocks_per_split, num_warps, num_stages, block_n: keys per
        inner block) are the ones `bench/decode_attention.py` sweeps; the defaults are the engine's."""
        self.block_n = block_n
        self.h, self.kvh, self.hd, self.cap = num_heads, num_kv_heads, head_dim, capacity
        self.group = num_heads // num_kv_heads
        self.num_sms = num_sms
        self.programs_per_sm, self.blocks_per_split = programs_per_sm, blocks_per_split
        self.num_warps, self.num_stages = num_warps, num_stages
        self.scale_log2 = (1.0 / math.sqrt(head_dim)) * 1.4426950408889634  # log2(e): softmax in base 2

    def splits(self, batch: int) -> int:
        """Key splits per (row, kv head): programs_per_sm x SMs programs in all, each split at least
        blocks_per_split key blocks of the capacity."""
        most = max(1, self.cap // (self.blocks_per_split * self.block_n))
        want = -(-self.programs_per_sm * self.num_sms // (batch * self.kvh))
        return min(_next_pow2(want), 1 << (most.bit_length() - 1))

    def _launch(self, kernel, b: int, device: torch.device, out: torch.Tensor, args: tuple, **meta) -> None:
        splits = self.splits(b)
        chunk = -(-self.cap // splits)
        chunk = -(-chunk // self.block_n) * self.block_n
        if splits > 1:
            part_o = torch.empty((b, self.h, splits, self.hd), dtype=torch.float32, device=device)
            part_lse = torch.empty((b, self.h, splits), dtype=torch.float32, device=device)
        else:
            part_o = part_lse = out
        kernel[(b, self.kvh, splits)](
            *args, out, part_o, part_lse, self.scale_log2, *meta.pop("scalars", ()),
            H=self.h, KVH=self.kvh, G=self.group, HD=self.hd, CAP=self.cap, CHUNK=chunk, SPLITS=splits,
            BLOCK_G=max(16, _next_pow2(self.group)), BLOCK_N=self.block_n, PIPELINE=not INTERPRET,
            NUM_STAGES=self.num_stages, num_warps=self.num_warps, **meta,
        )  # fmt: skip
        if splits > 1:
            kernels.attention_reduce_kernel[(b * self.h,)](
                part_o, part_lse, out, HD=self.hd, SPLITS=splits, BLOCK_S=max(2, _next_pow2(splits))
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor, out=None
    ) -> torch.Tensor:
        """q [B, H, HD]; caches [slots >= B, KVH, CAP, HD] (row b reads slot b; in q's dtype or FP8, which is
        read in q's); returns [B, H, HD]."""
        q, lens = _dense(q, lens)
        _check_dense(k_cache=k_cache, v_cache=v_cache, out=out)
        out = torch.empty_like(q) if out is None else out
        self._launch(kernels.decode_attention_kernel, q.shape[0], q.device, out, (q, k_cache, v_cache, lens))
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
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's token of each row: RoPE (after q/k-norm if given) of its q and k heads, its k and v
        written to cache[row, :, positions[row]], then attention over the positions < lens[row] (the
        cached ones before it and itself). qkv [B, (H + 2 KVH) x HD]; returns [B, H, HD]. bias
        [(H + 2 KVH) x HD]: qkv comes without the projection's bias, which is added here as `qkv + bias` adds it."""
        b = qkv.shape[0]
        qkv, positions, lens, rope_table, q_norm, k_norm, bias = _dense(
            qkv, positions, lens, rope_table, q_norm, k_norm, bias
        )
        _check_dense(k_cache=k_cache, v_cache=v_cache)
        if bias is not None and bias.shape != (qkv.shape[1],):
            raise ValueError(f"rope_attend: bias {tuple(bias.shape)} does not match qkv's {qkv.shape[1]} columns")
        out = torch.empty((b, self.h, self.hd), dtype=qkv.dtype, device=qkv.device)
        qk_norm = q_norm is not None
        args = (
            qkv, positions, lens, rope_table,
            q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, qkv if bias is None else bias, k_cache, v_cache,
        )  # fmt: skip
        self._launch(
            kernels.rope_decode_attention_kernel, b, qkv.device, out, args,
            scalars=(eps,), QK_NORM=qk_norm, KV_MAX=_kv_max(k_cache), HAS_BIAS=bias is not None,
        )  # fmt: skip
        return out


def silu_mul(
    gate_up: torch.Tensor,
    out: torch.Tensor | None = None,
    quantize: bool = False,
    block: int = SILU_BLOCK,
    num_warps: int = SILU_WARPS,
) -> torch.Tensor | fp8.QuantizedInput:
    """silu(gate) * up of gate_up [B, 2N] -> [B, N]; quantize: as the FP8 GEMM's input (`_quantized_output`).
    block (a power of two, at least 128), num_warps: a program's columns and warps (`bench/elementwise_kernels.py`
    sweeps them)."""
    b, n2 = gate_up.shape
    n = n2 // 2
    (gate_up,) = _dense(gate_up)
    _check_dense(out=out)
    if block < fp8.BLOCK or block & (block - 1):
        raise ValueError(f"silu_mul: block={block}; use a power of two of at least {fp8.BLOCK}")
    block = min(block, _next_pow2(n))  # quantizing, n is whole 128-groups: so are a program's columns
    if quantize:
        qi = _quantized_output(b, n, gate_up.dtype, gate_up.device, out)
        grid_rows, out, q, scales = qi.q.shape[0], gate_up, qi.q, qi.scales  # out: gate_up names the dtype alone
    else:
        out = torch.empty((b, n), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
        grid_rows, q, scales = b, out, out
    kernels.silu_mul_kernel[(grid_rows, triton.cdiv(n, block))](
        gate_up, out, q, scales, b, n, QUANT=quantize, BLOCK=block, GROUP=fp8.BLOCK, num_warps=num_warps
    )
    return qi if quantize else out


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
    kernels.sample_stats_kernel[(b, c)](logits, inv_temp, stats[0], stats[1], V=v, CH=ch, C=c, BLOCK=block)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    kernels.sample_pick_kernel[(b,)](
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
