"""Train/rollout mismatch corrections: per-token weights on the policy-gradient loss.

The engine and the trainer assign slightly different probabilities to the same sampled token,
so r = exp(logπ_old_trainer − logπ_rollout) drifts from 1. Two built-in corrections:
  clamp       (TIS)          w = clamp(r, lo, hi): an extreme token is damped.
  clip_or_pop (icepop-style) w = r inside [lo, hi], 0 outside: an extreme token is dropped, exactly
                             as if loss-masked, while the aggregation denominators stay unchanged.
Weights carry no gradient (both log-probs are fixed inputs of the step). Ratios exactly on a
bound are inside the interval (not clipped).

A custom correction (`--custom-tis-function-path`) has the signature of `tis_weights` without
`mode`: fn(old_log_probs, rollout_log_probs, loss_mask, *, lo, hi) -> (weights[T], info), where
info may carry per-token "ratio" (pre-clamp) and "clipped" (0/1) tensors for the metrics.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import Tensor

from miles.utils.misc import load_function

logger = logging.getLogger(__name__)

TIS_MODES = ("clamp", "clip_or_pop")
LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 5e8: large enough to be "clipped", small enough to stay finite


class _HasTisFlags(Protocol):
    tis_mode: str
    tis_clip: float
    tis_clip_low: float
    custom_tis_function_path: str | None


CorrectionFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


def tis_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    *,
    lo: float,
    hi: float,
    mode: Literal["clamp", "clip_or_pop"],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights [T] (0 on inactive tokens) and per-token info: ratio, clipped, abs_dev."""
    if not lo <= hi:
        raise ValueError(f"TIS bounds need --tis-clip-low <= --tis-clip, got lo={lo}, hi={hi}")
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"tis_weights: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    active = loss_mask != 0
    outside = (ratio < lo) | (ratio > hi)
    if mode == "clamp":
        weights = ratio.clamp(lo, hi)
    elif mode == "clip_or_pop":
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    else:
        raise ValueError(f"--tis-mode={mode!r} is not one of {TIS_MODES}")
    zeros = torch.zeros_like(ratio)
    weights = torch.where(active, weights, zeros)
    info = {
        "ratio": torch.where(active, ratio, zeros),
        "clipped": (outside & active).float(),
        "abs_dev": torch.where(active, (ratio - 1.0).abs(), zeros),
    }
    return weights, info


def load_correction(cfg: _HasTisFlags) -> CorrectionFn:
    """The correction of `cfg` with its bounds bound: fn(old_log_probs, rollout_log_probs, loss_mask)."""
    lo, hi = float(cfg.tis_clip_low), float(cfg.tis_clip)
    if cfg.custom_tis_function_path:
        fn = load_function(cfg.custom_tis_function_path)
        if not callable(fn):
            raise TypeError(f"--custom-tis-function-path {cfg.custom_tis_function_path!r} is not callable")
        logger.info("train/rollout correction: custom %s, bounds [%s, %s]", cfg.custom_tis_function_path, lo, hi)
        return functools.partial(fn, lo=lo, hi=hi)
    if cfg.tis_mode not in TIS_MODES:
        raise ValueError(f"--tis-mode={cfg.tis_mode!r} is not one of {TIS_MODES}")
    return functools.partial(tis_weights, lo=lo, hi=hi, mode=cfg.tis_mode)
