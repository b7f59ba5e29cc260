"""Loss aggregation over the packed per-token layout, with denominators fixed per optimizer step.

Per-token tensors are 1-D: the concatenation of the response tokens of the samples of a
micro-batch, segmented by `response_lengths` (zero-length responses allowed). Each micro-batch
returns its partial sum already divided by the *step* denominators, so summing the results over
micro-batches and data-parallel ranks gives exactly the single-process objective of the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

AGGREGATION_MODES = ("sample_mean", "token_mean", "seq_mean_token_sum")


class _HasAggregationFlags(Protocol):
    loss_aggregation: str | None
    calculate_per_token_loss: bool


@dataclass(slots=True)
class StepDenominators:
    num_samples: int  # samples in the whole optimizer step, all DP ranks
    num_tokens: int  # loss-mask sum over the whole optimizer step, all DP ranks


def resolve_aggregation(cfg: _HasAggregationFlags) -> str:
    """`--loss-aggregation`, defaulting to token_mean under `--calculate-per-token-loss`, else sample_mean."""
    mode = cfg.loss_aggregation or ("token_mean" if cfg.calculate_per_token_loss else "sample_mean")
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"--loss-aggregation={mode!r} is not one of {AGGREGATION_MODES}")
    return mode


def _check_layout(x: Tensor, response_lengths: list[int]) -> None:
    total = sum(response_lengths)
    if x.dim() != 1 or x.numel() != total:
        raise ValueError(
            f"per-token tensor has shape {tuple(x.shape)} but response_lengths sum to {total}; "
            "pass the 1-D concatenation of the response tokens of every sample (no padding)"
        )
    if any(n < 0 for n in response_lengths):
        raise ValueError(f"response_lengths must be >= 0, got {response_lengths}")


def segment_ids(response_lengths: list[int], device: torch.device | str | None = None) -> Tensor:
    """Sample index of every token: [0]*n0 + [1]*n1 + ... (int64, length sum(response_lengths))."""
    lengths = torch.as_tensor(response_lengths, dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(response_lengths), device=device), lengths)


def segment_sum(x: Tensor, response_lengths: list[int]) -> Tensor:
    """Per-sample sums [B] of a per-token tensor [T]; differentiable."""
    _check_layout(x, response_lengths)
    seg = segment_ids(response_lengths, x.device)
    return torch.zeros(len(response_lengths), dtype=x.dtype, device=x.device).index_add(0, seg, x)


def broadcast_to_tokens(per_sample: Tensor, response_lengths: list[int]) -> Tensor:
    """Repeat a per-sample value [B] over that sample's response tokens -> [T]."""
    if per_sample.shape != (len(response_lengths),):
        raise ValueError(
            f"per-sample tensor has shape {tuple(per_sample.shape)}, expected ({len(response_lengths)},) "
            "= one value per entry of response_lengths"
        )
    return per_sample[segment_ids(response_lengths, per_sample.device)]


def masked_values(x: Tensor, loss_mask: Tensor) -> Tensor:
    """x * mask with inactive tokens and non-finite values set to exactly 0 (NaN * 0 would stay NaN)."""
    mask = loss_mask.to(x.dtype)
    keep = (mask != 0) & torch.isfinite(x)
    return torch.where(keep, x * mask, torch.zeros_like(x))


def aggregate(x: Tensor, loss_mask: Tensor, response_lengths: list[int], mode: str, den: StepDenominators) -> Tensor:
    """This micro-batch's contribution to the step objective (a scalar).

    sample_mean:        Σ_i (Σ_t x m / max(Σ_t m, 1)) / num_samples
    token_mean:         Σ x m / max(num_tokens, 1)
    seq_mean_token_sum: Σ_i Σ_t x m / num_samples
    """
    _check_layout(x, response_lengths)
    if loss_mask.shape != x.shape:
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)} but x has {tuple(x.shape)}")
    xm = masked_values(x.float(), loss_mask)
    if mode == "token_mean":
        return xm.sum() / max(den.num_tokens, 1)
    if mode not in ("sample_mean", "seq_mean_token_sum"):
        raise ValueError(f"aggregation mode {mode!r} is not one of {AGGREGATION_MODES}")
    if den.num_samples < len(response_lengths):
        raise ValueError(
            f"StepDenominators.num_samples={den.num_samples} is smaller than the {len(response_lengths)} samples "
            "of this micro-batch; it must count every sample of the optimizer step over all DP ranks"
        )
    if mode == "seq_mean_token_sum":
        return xm.sum() / max(den.num_samples, 1)
    per_sample = segment_sum(xm, response_lengths)
    tokens_per_sample = segment_sum(loss_mask.float(), response_lengths)
    return (per_sample / tokens_per_sample.clamp(min=1.0)).sum() / max(den.num_samples, 1)
