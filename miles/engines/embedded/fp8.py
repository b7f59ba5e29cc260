"""FP8 serving: e4m3 weights with one scale per 128x128 block, W8A8 GEMMs with per-token-group activations.

The checkpoint format is the one Miles' FP8 rollouts read (DeepSeek-V3's): config.json carries
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`, every quantized `X.weight` is float8_e4m3fn and `X.weight_scale_inv`
[ceil(N/128), ceil(K/128)] float32 holds each block's dequantization scale (weight = q * scale_inv).
Quantized: the decoder's linear layers (q/k/v/o, gate/up/down); embeddings, norms, biases and the LM
head stay in the model dtype.

GEMM: activations are quantized per token and group of 128 channels, dynamically (scale = amax / 448; a K that
is not a multiple of 128 ends in a shorter group).
On Hopper (CUDA capability 9.x) `torch._scaled_mm` takes the 1x128 activation and 128x128 weight scales
directly (cuBLASLt's block-scaled path, CUDA >= 12.9); elsewhere, and wherever that call is refused,
the same W8A8 product is computed by dequantizing both operands (the CPU path CI runs; also every GEMM whose
K or padded N is not whole blocks). Where cuBLASLt (or the Triton GEMM) serves a GEMM (`takes_quantized_input`)
its input may come already quantized (a QuantizedInput, written by the engine's norm or SiLU kernel in place of its model-dtype
output; the same codes), and MILES_FP8_SPLIT_K cuts the K range of a GEMM with few output tiles into chunks
on parallel streams (fp8_split_k.py); MILES_FP8_GEMM_FORM hands cuBLASLt the same product in another of its
block-scaled forms (fp8_forms.py). MILES_FP8_GEMM=triton swaps cuBLASLt for fp8_triton.block_scaled_mm (see
GEMM below). MILES_FP8_CUDA_KERNELS=0 turns the forward's CUDA kernels off (see CUDA_KERNELS below): CUDA then
takes the dequantizing path, correct and slow. A weight push quantizes with the Triton kernel wherever it runs (it works outside the
forward and its CUDA graphs, and matches the torch form: tests/unit/test_triton_ops.py).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.engines.embedded import fp8_forms, fp8_split_k, fp8_triton
from miles.utils import cublaslt

# The CUDA kernels of this module (Triton quantization, cuBLASLt's block-scaled GEMM) on Hopper: on by default,
# MILES_FP8_CUDA_KERNELS=0 takes the dequantizing path CPU tests check (correct, and slower than bf16). History:
# they once gave log-probs 0.37 nats (mean) away from bf16 on an H200, because cuBLASLt reads the weight scales with
# a leading dimension of K/128 rounded up to 4 and every GEMM with K/128 % 4 != 0 used wrong scales; such GEMMs now
# run with K grown by zero blocks (pad_k_blocks). One engine run with the kernels then failed a CUDA-graph capture,
# unexplained, so they stayed off by default; it never recurred over the GPU test runs and the dozens of bench
# engine runs with them on (H200 and H100, bench/results/fp8.md) since. The weight quantization of a push is not
# part of that forward (quantize_weight).
_KERNELS_ENV = os.environ.get("MILES_FP8_CUDA_KERNELS", "1")
if _KERNELS_ENV not in ("0", "1"):
    raise ValueError(
        f"MILES_FP8_CUDA_KERNELS={_KERNELS_ENV!r}: use 1 (the default: the CUDA kernels) or 0 (dequantize)"
    )
CUDA_KERNELS = _KERNELS_ENV == "1"
# Which GEMM the kernels use: "cublas" (torch._scaled_mm's block-scaled cuBLASLt path, Hopper only) or "triton"
# (fp8_triton.block_scaled_mm on the activation kernel's codes, any N, no padding; any device with e4m3 tensor
# cores; checked against the emulation on CPU under Triton's interpreter and on an H100 / H200, where
# bench/fp8_gemm.py timed it at 1.37-1.51x cuBLASLt's time on a 7B layer's GEMMs at batch 256: off by default).
GEMM = os.environ.get("MILES_FP8_GEMM", "cublas")
if GEMM not in ("cublas", "triton"):
    raise ValueError(f"MILES_FP8_GEMM={GEMM!r}: use cublas or triton")
if fp8_split_k.SPLIT_K and (not CUDA_KERNELS or GEMM != "cublas"):  # it splits cuBLASLt's GEMMs only
    raise ValueError(
        f"MILES_FP8_SPLIT_K={fp8_split_k.SPLIT_K} splits cuBLASLt's GEMMs, which run only with "
        "the CUDA kernels (MILES_FP8_CUDA_KERNELS, on unless 0) and MILES_FP8_GEMM=cublas: set those, or unset MILES_FP8_SPLIT_K"
    )
if fp8_forms.FORM != "block" and (not CUDA_KERNELS or GEMM != "cublas" or fp8_split_k.SPLIT_K):
    raise ValueError(
        f"MILES_FP8_GEMM_FORM={fp8_forms.FORM} is a form of cuBLASLt's whole GEMM, which runs only with the CUDA "
        "kernels (MILES_FP8_CUDA_KERNELS, on unless 0), MILES_FP8_GEMM=cublas and no MILES_FP8_SPLIT_K: set those, "
        "or unset MILES_FP8_GEMM_FORM"
    )
# cuBLASLt's workspace (KiB), which torch reads once, at the process's first cuBLASLt call: unset, torch 2.11 gives
# it 1 MiB, and with that cuBLASLt runs the block-scaled GEMMs of few output tiles whole. With 32 MiB it splits K
# where that pays: on an H100 the 7B layer's down projection took 49.9 us instead of 58.9 at batch 256 (the layer's
# four GEMMs 148.6 against 157.6 us), and FP8 served 1.46x BF16's tokens/s against 1.36x (bench/results/fp8.md).
# Set here, when the engine's model code is imported (before its first GEMM), for an engine in any process; a value
# the user set is kept, and the controller gives every worker of a run the same (miles/utils/cublaslt.py).
CUBLASLT_WORKSPACE_KIB = cublaslt.set_default()
# Where cuBLASLt's GEMM serves a linear whose input comes from the engine's own norm or SiLU kernel, that kernel
# quantizes its output itself (a QuantizedInput: the same codes, no separate quantization launch; an H200 profile
# of the 7B decode step had those launches at 4% of it). A switch for tests and benchmarks to compare against.
FUSED_INPUT_QUANT = True

logger = logging.getLogger(__name__)

BLOCK = fp8_split_k.BLOCK  # the quantization block: 128 x 128 weights, 1 x 128 activations
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ROWS_MULTIPLE = 4  # cuBLASLt's block-scaled path wants the activation's rows a multiple of 4
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}
QUANTIZED_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def is_fp8_config(config: dict) -> bool:
    """Whether a model's config.json asks for FP8 serving; any other quantization_config is refused."""
    q = config.get("quantization_config")
    if not q:
        return False
    wanted = {k: q.get(k) for k in QUANT_CONFIG}
    if q.get("quant_method") != "fp8" or wanted["weight_block_size"] != [BLOCK, BLOCK]:
        raise ValueError(
            f"quantization_config {q!r} is not served by the embedded engine; it serves {QUANT_CONFIG!r} "
            "(write one with `miles convert fp8 SRC DST`)"
        )
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config {q!r}: only fmt e4m3 with dynamic activations is served")
    return True


def is_quantized_name(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(QUANTIZED_SUFFIXES)


# ---- quantization ---------------------------------------------------------------------------------
def quantize_weight(
    w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, scale_inv [ceil(N/128), ceil(K/128)] fp32) with w ~= q * scale_inv blockwise, on w's device
    (on CUDA one Triton pass, fp8_triton.py, whatever CUDA_KERNELS says: the torch form reads and writes every
    element about five times, which a weight push would pay on every tensor). `out`: the (q, scale_inv) to
    write into, on w's device (the Triton pass stores there directly: a push writes a weight's storage with no
    temporary)."""
    if w.is_cuda and fp8_triton.runs_on(w.device):
        if out is not None and out[0].is_contiguous() and out[1].is_contiguous():
            return fp8_triton.quantize_weight(w, out)
        q, scale_inv = fp8_triton.quantize_weight(w)
        if out is None:
            return q, scale_inv
    else:
        q, scale_inv = quantize_weight_torch(w)
        if out is None:
            return q, scale_inv
    out[0].copy_(q)
    out[1].copy_(scale_inv)
    return out


def quantize_weight_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight` in torch ops on any device (the same bytes as the Triton pass; what torch.compile traces)."""
    N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    padded = F.pad(w.float(), (0, kb * BLOCK - K, 0, nb * BLOCK - N)).view(nb, BLOCK, kb, BLOCK)
    amax = padded.abs().amax(dim=(1, 3))
    scale_inv = torch.clamp(amax, min=1e-12) / E4M3_MAX
    q = (padded / scale_inv[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous(), scale_inv


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape
    scale = scale_inv.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (q.float() * scale).to(dtype)


def error_bound(dq: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Largest |w - dq| of an e4m3 round trip, elementwise: 3 mantissa bits round to within 1/16 of |w|
    (so within |dq| / 15), and subnormals to within 2^-10 of the block's scale."""
    N, K = dq.shape
    scale = scale_inv.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return dq.abs() / 15 + scale * 2.0**-10


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 channels: (q [M, K] e4m3, scales [M, ceil(K/128)] fp32); a last group of
    fewer channels is scaled by its own amax (as if zero-padded: zeros change no amax)."""
    M, K = x.shape
    G = math.ceil(K / BLOCK)
    groups = F.pad(x.float(), (0, G * BLOCK - K)).view(M, G, BLOCK)
    scale = torch.clamp(groups.abs().amax(dim=-1), min=1e-12) / E4M3_MAX
    q = (groups / scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(M, G * BLOCK)[:, :K], scale


@dataclass(slots=True)
class QuantizedInput:
    """A linear's input [rows, K] already quantized as the block-scaled GEMMs (cuBLASLt's, Triton's) take it (what
    `linear` would otherwise compute with fp8_triton.quantize_activation(x, pad_to=ROWS_MULTIPLE)): `q` [M_pad, K] e4m3 (rows
    past `rows` zero), `scales` [M_pad, K/128] fp32 with stride (1, M_pad), M_pad = rows rounded up to
    ROWS_MULTIPLE; `dtype`: the model dtype the unquantized input had, the GEMM's output dtype. The engine's
    norm and SiLU kernels write one (triton_ops, `quantize=True`) for a weight that `takes_quantized_input`."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.q.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self) -> torch.Tensor:
        """[rows, K] fp32: each code times its group's scale (what the W8A8 product reads)."""
        return self.q[: self.rows].float() * self.scales[: self.rows].repeat_interleave(BLOCK, 1)


# ---- the weight and its GEMM ----------------------------------------------------------------------
@dataclass(slots=True)
class Fp8Weight:
    """A [N, K] linear weight as e4m3 `q` and its block scales; rows [a:b] is a view (a a multiple of 128).

    `keep`: for a fused projection whose parts were laid out from block boundaries (zero rows between them,
    so that each part owns its blocks), the rows of `q` that are the projection's outputs, in order; the
    GEMM's output keeps those columns."""

    q: torch.Tensor
    scale_inv: torch.Tensor
    keep: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The projection's [N, K] (without the rows that only pad parts to whole blocks)."""
        return self.q.shape if self.keep is None else torch.Size((self.keep.numel(), self.q.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, rows: slice | tuple[slice]) -> Fp8Weight:
        if isinstance(rows, tuple):  # the engine's views index as (slice,)
            (rows,) = rows
        start, stop = rows.start or 0, rows.stop if rows.stop is not None else self.q.shape[0]
        return Fp8Weight(self.q[start:stop], self.scale_inv[start // BLOCK : math.ceil(stop / BLOCK)])

    def to(self, device: torch.device | str) -> Fp8Weight:
        keep = None if self.keep is None else self.keep.to(device)
        return Fp8Weight(self.q.to(device), self.scale_inv.to(device), keep)

    def copy_(self, w: torch.Tensor) -> None:
        """Quantize w (any float dtype) on this weight's device, per block, and store it in place (a weight
        push: the engine's `params[name].copy_(tensor)` lands here for a quantized name)."""
        quantize_weight(w.to(self.q.device), out=(self.q, self.scale_inv))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = dequantize_weight(self.q, self.scale_inv, dtype)
        return w if self.keep is None else w.index_select(0, self.keep)

    @classmethod
    def from_parts(cls, w: torch.Tensor, parts: list[tuple[int, int]]) -> tuple[Fp8Weight, list[int]]:
        """A fused [N, K] weight whose parts (row ranges [a, b) covering the N rows once) do not all start and
        end on 128-row block boundaries: each part is laid out from a block boundary, in row order, zero rows
        up to the next boundary, and quantized there. Returns the weight and each part's first row in `q`."""
        order = sorted(range(len(parts)), key=lambda i: parts[i][0])
        if sum(b - a for a, b in parts) != w.shape[0] or any(
            parts[i][1] != parts[j][0] for i, j in zip(order, order[1:], strict=False)
        ):
            raise ValueError(f"the parts {parts} do not cover the {w.shape[0]} rows of the fused weight once")
        starts, row = [0] * len(parts), 0
        for i in order:
            starts[i] = row
            row += math.ceil((parts[i][1] - parts[i][0]) / BLOCK) * BLOCK
        padded = w.new_zeros((row, w.shape[1]))
        keep = torch.empty(w.shape[0], dtype=torch.long, device=w.device)
        for (a, b), start in zip(parts, starts, strict=True):
            padded[start : start + b - a] = w[a:b]
            keep[a:b] = torch.arange(start, start + b - a, device=w.device)
        return cls(*quantize_weight(padded), keep=keep), starts


# (device, whether K is grown to a multiple of 512) -> torch._scaled_mm takes the call: a refusal of one kind
# (see pad_k_blocks) leaves the other on cuBLASLt
_scaled_mm_ok: dict[tuple[torch.device, bool], bool] = {}
# device -> split-K GEMMs (fp8_split_k) run there: a refused chunk leaves the whole GEMMs on cuBLASLt
_split_ok: dict[torch.device, bool] = {}


@functools.cache
def _hopper(device: torch.device) -> bool:
    return CUDA_KERNELS and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _triton_gemm(device: torch.device) -> bool:
    """The Triton GEMM serves this device: asked for, and e4m3 tensor cores (CUDA capability 8.9 and up)."""
    return (
        CUDA_KERNELS
        and GEMM == "triton"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 9)
        and fp8_triton.runs_on(device)
    )


def linear(x: torch.Tensor | QuantizedInput, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (model dtype) @ w.T (+ bias) as a W8A8 GEMM; returns x's dtype. x may come quantized
    (a QuantizedInput [M, K]): cuBLASLt's GEMM takes it as is, any other path reads its dequantized values
    (the same operand, so the same product as from the model-dtype input it was quantized from)."""
    shape = x.shape
    flat = x if isinstance(x, QuantizedInput) else x.reshape(-1, shape[-1])
    N, K = w.q.shape
    out = None
    if _triton_gemm(x.device):
        out = _triton_mm(flat, w)
    elif _cublas_serves(x.device, N, K):
        out = _block_scaled_mm(flat, w, x.dtype)
    if out is None:
        out = _emulated(flat, w, x.dtype)
    if w.keep is not None:  # a fused projection's parts padded to whole blocks: its outputs only
        out = out.index_select(1, w.keep)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


def _triton_mm(x: torch.Tensor | QuantizedInput, w: Fp8Weight) -> torch.Tensor:
    """The Triton block-scaled GEMM (MILES_FP8_GEMM=triton). Its input quantized once, by the activation kernel
    (or already, by the norm or SiLU kernel before it), rather than inside the GEMM, where every column tile would
    quantize its rows again: on an H100 a 7B layer took 1.37-1.51x cuBLASLt's time this way, against 4.3x quantizing
    inside (bench/results/fp8.md). The same codes either way, so the same product. A K that is not whole 128-blocks,
    which the activation kernel does not take, is quantized inside."""
    if not isinstance(x, QuantizedInput):
        if x.shape[1] % BLOCK:
            return fp8_triton.quantized_linear(x, w.q, w.scale_inv)
        x = QuantizedInput(*fp8_triton.quantize_activation(x), x.shape[0], x.dtype)
    out = fp8_triton.block_scaled_mm(x.q, x.scales, w.q, w.scale_inv, x.dtype)
    return out[: x.rows] if out.shape[0] != x.rows else out


def takes_quantized_input(w: Fp8Weight | torch.Tensor) -> bool:
    """Whether `linear` would run this weight's GEMM on a path that reads a pre-quantized input as is (cuBLASLt's
    block-scaled GEMM, or the Triton one with MILES_FP8_GEMM=triton): then the kernel that produces the input may
    hand it over as a QuantizedInput. False for a plain (bf16) weight, with MILES_FP8_CUDA_KERNELS=0, on a device
    neither GEMM serves (cuBLASLt's: Hopper; Triton's: e4m3 tensor cores), for K (and for cuBLASLt N) not whole
    128-blocks, once torch refused cuBLASLt's call, and with FUSED_INPUT_QUANT off; a refusal after this said
    True still gives the right product (`linear` dequantizes the input)."""
    if not FUSED_INPUT_QUANT or not isinstance(w, Fp8Weight):
        return False
    N, K = w.q.shape
    if GEMM == "triton":
        return K % BLOCK == 0 and _triton_gemm(w.device)
    return _cublas_serves(w.device, N, K)


def _cublas_serves(device: torch.device, N: int, K: int) -> bool:
    """cuBLASLt's block-scaled GEMM takes w [N, K] on `device`: Hopper with the kernels on, whole blocks, and no
    refusal of this kind of call seen."""
    return K % BLOCK == 0 and N % BLOCK == 0 and _hopper(device) and _scaled_mm_ok.get(_mm_key(device, K), True)


def _mm_key(device: torch.device, K: int) -> tuple[torch.device, bool]:
    return device, (K // BLOCK) % 4 != 0


cublas_weight_scales = fp8_forms.cublas_weight_scales  # the block form's scale_b, shared with the other forms


def pad_k_blocks(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operands of a block-scaled GEMM with K grown to a multiple of 512 by zero blocks (exact: they add 0).

    cuBLASLt reads 128x128 weight scales with a leading dimension of K/128 rounded up to 4: torch 2.11's
    _scaled_mm took unpadded scales and computed with the wrong ones, and refused padded scales whose shape
    keeps K/128 (on the H200), so the product runs where it matched: K/128 % 4 == 0. xq [M, K] e4m3, xs [M, L], wq [N, K] e4m3,
    ws [NB, L] -> xq [M, K4], xs [M, L4] outer-dim-major, wq [N, K4], ws [NB, L4]; the added scales are 1."""
    L = xs.shape[1]
    L4 = -(-L // 4) * 4
    extra = (L4 - L) * BLOCK

    def zero_blocks(q: torch.Tensor) -> torch.Tensor:
        return F.pad(q.view(torch.uint8), (0, extra)).view(q.dtype)  # byte 0 is +0.0 in e4m3

    xs4 = F.pad(xs, (0, L4 - L), value=1.0).t().contiguous().t()
    return zero_blocks(xq), xs4, zero_blocks(wq), F.pad(ws, (0, L4 - L), value=1.0)


def _quantized(x: torch.Tensor) -> QuantizedInput:
    """x [M, K] (K % 128 == 0) quantized for cuBLASLt: rows padded to ROWS_MULTIPLE, scales outer-dim-major."""
    if fp8_triton.runs_on(x.device):  # one kernel; scales already outer-dim-major
        return QuantizedInput(*fp8_triton.quantize_activation(x, pad_to=ROWS_MULTIPLE), x.shape[0], x.dtype)
    pad = (-x.shape[0]) % ROWS_MULTIPLE
    xq, xs = quantize_activation(F.pad(x, (0, 0, 0, pad)) if pad else x)
    return QuantizedInput(xq, xs.t().contiguous().t(), x.shape[0], x.dtype)


def _block_scaled_mm(
    x: torch.Tensor | QuantizedInput, w: Fp8Weight, dtype: torch.dtype, splits: int | str | None = None
) -> torch.Tensor | None:
    """cuBLASLt's block-scaled FP8 GEMM of x [M, K] (quantized here unless it comes quantized) in `dtype`; None
    (and the emulation from then on) where torch refuses it. `splits`: the K chunks' policy (fp8_split_k; its
    SPLIT_K when None)."""
    N, K = w.q.shape
    if not isinstance(x, QuantizedInput):
        x = _quantized(x)
    xq, xs, wq, ws = x.q, x.scales, w.q, w.scale_inv
    if ws.shape[1] % 4:
        xq, xs, wq, ws = pad_k_blocks(xq, xs, wq, ws)
    elif _split_ok.get(x.device, True) and (n := fp8_split_k.splits_for(xq.shape[0], N, K, x.device, splits)) > 1:
        try:
            out = fp8_split_k.split_k_mm(xq, xs, wq, ws, dtype, n)
            return out[: x.rows] if out.shape[0] != x.rows else out
        except (RuntimeError, ValueError, NotImplementedError) as e:
            _split_ok[x.device] = False
            logger.warning("torch._scaled_mm refused a K chunk of a split FP8 GEMM (%s); GEMMs run whole", e)
    if (out := fp8_forms.serve(xq, xs, wq, ws, dtype, form_sample)) is not None:  # MILES_FP8_GEMM_FORM
        return out[: x.rows] if out.shape[0] != x.rows else out
    try:
        out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=cublas_weight_scales(ws), out_dtype=dtype)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        _scaled_mm_ok[_mm_key(x.device, K)] = False
        logger.warning(
            "torch._scaled_mm refused 128-block FP8 scaling (%s); dequantizing every GEMM whose K/128 is%s a "
            "multiple of 4",
            e,
            " not" if _mm_key(x.device, K)[1] else "",
        )
        return None
    return out[: x.rows] if out.shape[0] != x.rows else out


def form_sample(device: torch.device) -> tuple[torch.Tensor, ...]:
    """(xq, xs, wq, ws, want) of a small W8A8 product on `device`, laid out as `_block_scaled_mm` passes its
    operands (block scales that differ from block to block), and its fp32 value: what fp8_forms probes a GEMM
    form's scale layouts on."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.rand(256, 1, generator=g) + 0.05
    w = Fp8Weight(*quantize_weight((torch.randn(256, 512, generator=g) * rows).to(device, torch.bfloat16)))
    x = _quantized(torch.randn(64, 512, generator=g).to(device, torch.bfloat16))
    return x.q, x.scales, w.q, w.scale_inv, _emulated(x, w, torch.float32)


def dequantize_activation(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] after its per-token, per-128-channel e4m3 round trip, in fp32 (what the W8A8 product reads)."""
    xq, xs = quantize_activation(x)
    return xq.float() * xs.repeat_interleave(BLOCK, 1)[:, : x.shape[1]]


def _emulated(x: torch.Tensor | QuantizedInput, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The same W8A8 product with both operands dequantized (exact products, fp32 sums); a QuantizedInput is
    read as its codes say, not quantized again."""
    xd = x.dequantize() if isinstance(x, QuantizedInput) else dequantize_activation(x)
    return F.linear(xd, dequantize_weight(w.q, w.scale_inv, torch.float32)).to(dtype)


# ---- checkpoints ------------------------------------------------------------------------------------
def read_checkpoint(named, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors of an FP8 checkpoint, quantized ones dequantized to `dtype` with their
    `weight_scale_inv` (the model then requantizes its fused storage: the same blocks, the same bytes
    when the checkpoint's scales are amax / 448)."""
    tensors = dict(named)
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == E4M3:
            scale = tensors.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"FP8 checkpoint: {name} is float8 but {name}_scale_inv is missing")
            out[name] = dequantize_weight(t, scale.float(), dtype)
        else:
            out[name] = t.to(dtype)
    return out


def convert_state(named) -> dict[str, torch.Tensor]:
    """A BF16 checkpoint's tensors as an FP8 one's: quantized names as e4m3 + `weight_scale_inv`, the rest as is."""
    out = {}
    for name, t in named:
        if is_quantized_name(name) and t.dim() == 2:
            q, scale_inv = quantize_weight(t)
            out[name], out[name + "_scale_inv"] = q, scale_inv
        else:
            out[name] = t
    return out
