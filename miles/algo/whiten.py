"""Masked whitening whose statistics span every data-parallel rank.

Each rank holds a slice of the step's tokens; whitening with rank-local statistics would give a
different normalisation per rank. The mask-weighted mean and (population) variance are computed
from all-reduced sums, so every rank applies the statistics of the whole step. Two reductions
(mean first, then the centred second moment) avoid the cancellation of E[x²] − E[x]².
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)


def _all_reduce_sum(t: Tensor, group: ProcessGroup | None) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def masked_mean_var(x: Tensor, mask: Tensor, *, group: ProcessGroup | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Mask-weighted (mean, population variance, mask sum) over all ranks of `group`; fp32 scalars."""
    xf = x.detach().float()
    m = mask.detach().float()
    xm = torch.where(m != 0, xf * m, torch.zeros_like(xf))
    sums = _all_reduce_sum(torch.stack([xm.sum(), m.sum()]), group)
    count = sums[1]
    mean = sums[0] / count.clamp(min=1e-12)
    centred = torch.where(m != 0, (xf - mean).square() * m, torch.zeros_like(xf))
    var = _all_reduce_sum(centred.sum().reshape(1), group)[0] / count.clamp(min=1e-12)
    return mean, var, count


def masked_whiten(
    x: Tensor, mask: Tensor, *, group: ProcessGroup | None = None, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """(x − μ) / sqrt(σ² + eps) with mask-weighted μ, σ² over every rank of `group` (default: world).

    shift_mean=False adds μ back (scale only). Positions with mask 0 are returned as 0. When
    torch.distributed is initialised this is a collective: every rank of `group` must call it,
    even a rank whose tokens are all masked. If no token on any rank is active, returns zeros.
    """
    if x.shape != mask.shape:
        raise ValueError(f"masked_whiten: x {tuple(x.shape)} and mask {tuple(mask.shape)} differ")
    mean, var, _ = masked_mean_var(x, mask, group=group)
    active = mask != 0
    # No active token anywhere: mean = var = 0 and every position is masked, so the result is 0.
    out = (x.float() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(active, out, torch.zeros_like(out))
