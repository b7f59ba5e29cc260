"""Losses behind one typed interface: fn(cfg, LossInputs) -> (loss, metrics).

The returned loss is a scalar already divided by the step denominators (`StepDenominators`), so
the trainer just sums micro-batch losses (and sums gradients over DP ranks). Every metric is a
detached scalar *contribution* aggregated the same way, so summing a metric over micro-batches
and ranks gives its value for the step. Per-token tensors are 1-D, segmented by response_lengths.

Policy loss (PPO clip, optional dual clip), per token with ppo_kl = logπ_old − logπ_θ:
  r = exp(clamp(−ppo_kl, −20, 20)), L = max(−r·A, −clip(r, 1−ε_l, 1+ε_h)·A)
  dual clip (c > 1), for A < 0: L = min(−c·A, L)
  gspo: ppo_kl is the sequence's masked mean, broadcast to its tokens.
  TIS / clip-or-pop: L ← L · w(old, rollout) with w from `miles.algo.corrections`.
  total = agg(L) − entropy_coef·agg(H) + kl_loss_coef·agg(KL(π_θ, π_ref)) [--use-kl-loss]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo.aggregation import (
    StepDenominators,
    aggregate,
    broadcast_to_tokens,
    masked_values,
    resolve_aggregation,
    segment_sum,
)
from miles.algo.corrections import load_correction
from miles.algo.kl import compute_approx_kl
from miles.config import AlgoConfig
from miles.utils.misc import load_function

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0

LossFn = Callable[[AlgoConfig, "LossInputs"], tuple[Tensor, dict[str, Tensor]]]


@dataclass(slots=True)
class LossInputs:
    log_probs: Tensor  # current policy, with gradient
    loss_mask: Tensor
    response_lengths: list[int]
    den: StepDenominators
    old_log_probs: Tensor | None = None
    advantages: Tensor | None = None
    rollout_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    entropy: Tensor | None = None
    values: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    teacher_log_probs: Tensor | None = None  # only for the opd_reverse_kl metric
    opd_reverse_kl: Tensor | None = None  # precomputed (top-K) estimate; preferred for the metric


class _Aggregator:
    """agg(x) for one micro-batch, with the step's mode and denominators."""

    __slots__ = ("mask", "lengths", "mode", "den")

    def __init__(self, cfg: AlgoConfig, inp: LossInputs) -> None:
        self.mask, self.lengths, self.den = inp.loss_mask, inp.response_lengths, inp.den
        self.mode = resolve_aggregation(cfg)

    def __call__(self, x: Tensor) -> Tensor:
        return aggregate(x, self.mask, self.lengths, self.mode, self.den)

    def metric(self, x: Tensor) -> Tensor:
        return aggregate(x.detach(), self.mask, self.lengths, self.mode, self.den).detach()


def _require(value: Tensor | None, name: str, why: str) -> Tensor:
    if value is None:
        raise ValueError(f"{why} needs LossInputs.{name}, which is None")
    return value


def _zero_inactive(x: Tensor, active: Tensor) -> Tensor:
    """Inactive tokens and non-finite values become exactly 0 (gradient through the kept ones only)."""
    return torch.where(active & torch.isfinite(x), x, torch.zeros_like(x))


def _old_log_probs(cfg: AlgoConfig, inp: LossInputs) -> Tensor:
    if inp.old_log_probs is not None:
        return inp.old_log_probs.detach().float()
    if cfg.use_rollout_logprobs and inp.rollout_log_probs is not None:
        return inp.rollout_log_probs.detach().float()
    raise ValueError("policy_loss needs LossInputs.old_log_probs (or rollout_log_probs with --use-rollout-logprobs)")


def _sequence_mean(x: Tensor, mask: Tensor, response_lengths: list[int]) -> Tensor:
    """Masked mean of each sample broadcast back to its tokens (GSPO's sequence-level log ratio)."""
    sums = segment_sum(masked_values(x, mask), response_lengths)
    counts = segment_sum(mask.float(), response_lengths).clamp(min=1.0)
    return broadcast_to_tokens(sums / counts, response_lengths)


def ppo_clip_loss(
    ppo_kl: Tensor, advantages: Tensor, *, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate loss and clip indicator (1 where the clipped branch is active)."""
    ratio = torch.exp(torch.clamp(-ppo_kl, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac


def _correction_metrics(agg: _Aggregator, old: Tensor, rollout: Tensor, weights_info: dict[str, Tensor]) -> dict:
    ratio = weights_info.get("ratio")
    if ratio is None:
        ratio = torch.exp(torch.clamp(old - rollout, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    out = {"tis": agg.metric(ratio), "tis_abs": agg.metric((ratio - 1.0).abs())}
    if "clipped" in weights_info:
        out["tis_clipfrac"] = agg.metric(weights_info["clipped"].float())
    return out


def policy_loss(cfg: AlgoConfig, inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (+ TIS weights, entropy bonus, KL loss) for one micro-batch."""
    agg = _Aggregator(cfg, inp)
    active = inp.loss_mask != 0
    new = inp.log_probs.float()
    old = _old_log_probs(cfg, inp)
    advantages = _zero_inactive(_require(inp.advantages, "advantages", "policy_loss").detach().float(), active)

    ppo_kl = old - new
    if cfg.advantage_estimator == "gspo":
        ppo_kl = _sequence_mean(ppo_kl, inp.loss_mask, inp.response_lengths)
    ppo_kl = _zero_inactive(ppo_kl, active)
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    pg, clipfrac = ppo_clip_loss(
        ppo_kl, advantages, eps_clip=cfg.eps_clip, eps_clip_high=eps_high, eps_clip_c=cfg.eps_clip_c
    )

    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:
        rollout = _require(inp.rollout_log_probs, "rollout_log_probs", "--use-tis").detach().float()
        weights, info = load_correction(cfg)(old, rollout, inp.loss_mask)
        pg = pg * weights.detach()
        metrics.update(_correction_metrics(agg, old, rollout, info))

    pg_loss = agg(pg)
    loss = pg_loss
    if inp.entropy is not None and cfg.entropy_coef != 0:
        entropy_loss = agg(inp.entropy.float())
        metrics["entropy_loss"] = entropy_loss.detach()
        loss = loss - cfg.entropy_coef * entropy_loss
    elif inp.entropy is not None:  # observed only: no gradient through the entropy
        metrics["entropy_loss"] = agg.metric(inp.entropy.float())
    elif cfg.entropy_coef != 0:
        raise ValueError(f"--entropy-coef {cfg.entropy_coef} needs LossInputs.entropy, which is None")
    if cfg.use_kl_loss:
        ref = _require(inp.ref_log_probs, "ref_log_probs", "--use-kl-loss").detach()
        kl_loss = agg(compute_approx_kl(new, ref, cfg.kl_loss_type))
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss

    metrics.update(
        loss=loss.detach(),
        pg_loss=pg_loss.detach(),
        pg_clipfrac=agg.metric(clipfrac),
        ppo_kl=agg.metric(ppo_kl),
        ois=agg.metric(torch.exp(torch.clamp(new - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))),
    )
    metrics.update(_mismatch_metrics(agg, old, inp))
    return loss, metrics


def _mismatch_metrics(agg: _Aggregator, old: Tensor, inp: LossInputs) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    if inp.rollout_log_probs is not None:
        rollout = inp.rollout_log_probs.detach().float()
        out["train_rollout_logprob_abs_diff"] = agg.metric((old - rollout).abs())
        out["train_rollout_kl"] = agg.metric(compute_approx_kl(rollout, old, "low_var_kl"))
    if inp.opd_reverse_kl is not None:
        out["opd_reverse_kl"] = agg.metric(inp.opd_reverse_kl.float())
    elif inp.teacher_log_probs is not None:
        out["opd_reverse_kl"] = agg.metric(old - inp.teacher_log_probs.float())
    return out


def value_loss(cfg: AlgoConfig, inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """max((V_clip − R)², (V − R)²), V_clip = V_old + clamp(V − V_old, ±value_clip); no 0.5 factor."""
    agg = _Aggregator(cfg, inp)
    values = _require(inp.values, "values", "value_loss").float()
    old_values = _require(inp.old_values, "old_values", "value_loss").detach().float()
    returns = _require(inp.returns, "returns", "value_loss").detach().float()
    clipped_values = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    loss = agg(per_token)
    return loss, {
        "loss": loss.detach(),
        "value_loss": loss.detach(),
        "value_clipfrac": agg.metric((clipped_loss > unclipped_loss).float()),
    }


def sft_loss(cfg: AlgoConfig, inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the masked (trained-on) tokens."""
    agg = _Aggregator(cfg, inp)
    loss = agg(-inp.log_probs.float())
    return loss, {"loss": loss.detach()}


_BUILTIN: dict[str, LossFn] = {"policy_loss": policy_loss, "value_loss": value_loss, "sft_loss": sft_loss}


def get_loss_function(cfg: AlgoConfig) -> LossFn:
    """The loss for cfg.loss_type; "custom_loss" loads --custom-loss-function-path (same signature)."""
    if cfg.loss_type == "custom_loss":
        if not cfg.custom_loss_function_path:
            raise ValueError("--loss-type custom_loss needs --custom-loss-function-path pkg.module:fn")
        fn = load_function(cfg.custom_loss_function_path)
        if not callable(fn):
            raise TypeError(f"--custom-loss-function-path {cfg.custom_loss_function_path!r} is not callable")
        return fn
    try:
        return _BUILTIN[cfg.loss_type]
    except KeyError:
        raise ValueError(f"--loss-type={cfg.loss_type!r} is not one of {sorted(_BUILTIN) + ['custom_loss']}") from None
