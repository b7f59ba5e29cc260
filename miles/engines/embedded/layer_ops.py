"""The eager building blocks of a decoder layer: RMSNorm with HF's numerics, and linear (and linear plus the
residual add) over a plain weight or an FP8 one (fp8.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from miles.engines.embedded import fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm in the weight's dtype. An fp32 `x` with a lower-precision weight (the fp32 residual stream
    of a bf16 model) is normalised in fp32 and rounded once, as HF rounds before its weight multiply."""
    if x.dtype != weight.dtype and x.dtype == torch.float32:
        y = (
            F.rms_norm(x, (x.shape[-1],), eps=eps)
            if x.is_cuda
            else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        )
        return weight * y.to(weight.dtype)
    if x.is_cuda:  # one fused kernel (fp32 inside); bf16: last-bit differences from HF's formula
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    if x.dtype == torch.float32:  # HF's formula, in fewer CPU ops than F.rms_norm's composite
        eps_t, dim_t = _norm_constants(eps, x.shape[-1])
        mean_sq_eps = torch.addcdiv(eps_t, x.pow(2).sum(-1, keepdim=True), dim_t)  # == mean(x^2) + eps
        return (x * mean_sq_eps.rsqrt_()).mul_(weight)  # == weight * (x * rsqrt(...))
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@functools.cache
def _norm_constants(eps: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """eps and the row size as fp32 scalar tensors: a Python number operand costs a dtype conversion
    per op on CPU (what torch.mean and `+ eps` do), a matching scalar tensor does not."""
    return torch.tensor(eps, dtype=torch.float32), torch.tensor(float(dim), dtype=torch.float32)


def linear(
    x: torch.Tensor | fp8.QuantizedInput, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, or the W8A8 GEMM of an FP8 weight (fp8.py), which may take x already quantized (only it)."""
    if isinstance(weight, fp8.Fp8Weight):
        return fp8.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_residual(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """h + F.linear(x, weight, bias), the residual add done by the GEMM's accumulate when there is no bias and
    `h` has the GEMM's dtype (an fp32 stream adds the model-dtype product)."""
    if isinstance(weight, fp8.Fp8Weight):
        return h + fp8.linear(x, weight, bias)
    if bias is not None or h.dtype != x.dtype:
        return h + F.linear(x, weight, bias)
    return torch.addmm(h, x, weight.t())
