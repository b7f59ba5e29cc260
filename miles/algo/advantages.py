"""Advantage estimators over the packed per-token layout.

Order per step: KL-in-reward -> estimator -> OPD penalty -> whitening (`--normalize-advantages`).
Rewards arrive per sample: already group-normalised (r̃) for grpo / gspo /
reinforce_plus_plus_baseline, raw for reinforce_plus_plus / ppo. Positions with loss_mask 0 (tool
output, prompt-like spans inside a response) carry advantage and return 0.

  grpo, gspo                   A_t = R_t = r̃ (gspo differs only in the loss's ratio)
  reinforce_plus_plus_baseline A_t = R_t = r̃ − kl_coef·kl_t
  reinforce_plus_plus          ρ_t = −kl_coef·kl_t, + r at the last trainable token; A = R = G,
                               G_t = ρ_t + γ G_{t+1} over every response position
  ppo                          GAE over the trainable positions only (masked positions are not MDP
                               steps), reward at the last trainable one, V = 0 after it
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from miles.algo.aggregation import broadcast_to_tokens, resolve_aggregation, segment_ids, segment_sum
from miles.algo.corrections import TIS_MODES
from miles.algo.kl import KL_TYPES, compute_approx_kl
from miles.algo.opd import apply_opd
from miles.algo.whiten import masked_whiten
from miles.config import AlgoConfig

logger = logging.getLogger(__name__)

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
_SCAN_CHUNK = 128  # chunk of the discounted scan: a [C, C] matmul per chunk, powers stay representable


def check_algo_config(cfg: AlgoConfig) -> None:
    """Reject combinations of AlgoConfig flags that cannot work, with the fix in the message."""
    if cfg.advantage_estimator not in ESTIMATORS:
        raise ValueError(f"--advantage-estimator={cfg.advantage_estimator!r} is not one of {ESTIMATORS}")
    if cfg.advantage_estimator.startswith("reinforce_plus_plus") and not cfg.normalize_advantages:
        raise ValueError(f"--advantage-estimator {cfg.advantage_estimator} needs --normalize-advantages")
    if cfg.advantage_estimator == "ppo" and cfg.kl_coef != 0:
        raise ValueError(
            f"--advantage-estimator ppo does not shape rewards with KL: got --kl-coef {cfg.kl_coef}; "
            "use --use-kl-loss with --kl-loss-coef instead"
        )
    if cfg.kl_coef != 0 and cfg.use_kl_loss and cfg.kl_loss_coef != 0:
        raise ValueError(
            f"--kl-coef {cfg.kl_coef} and --kl-loss-coef {cfg.kl_loss_coef} are both non-zero; "
            "pick KL in the reward or KL as a loss, not both"
        )
    if cfg.kl_loss_type not in KL_TYPES:
        raise ValueError(f"--kl-loss-type={cfg.kl_loss_type!r} is not one of {KL_TYPES}")
    if cfg.eps_clip_c is not None and cfg.eps_clip_c <= 1.0:
        raise ValueError(f"--eps-clip-c must be > 1 (dual clip lower-bounds the loss at c·|A|), got {cfg.eps_clip_c}")
    if cfg.use_tis and cfg.use_rollout_logprobs:
        raise ValueError(
            "--use-tis and --use-rollout-logprobs exclude each other: with rollout log-probs as the "
            "old policy the train/rollout ratio is 1 by construction"
        )
    if cfg.tis_mode not in TIS_MODES and not cfg.custom_tis_function_path:
        raise ValueError(f"--tis-mode={cfg.tis_mode!r} is not one of {TIS_MODES}")
    if cfg.tis_clip_low > cfg.tis_clip:
        raise ValueError(f"--tis-clip-low {cfg.tis_clip_low} is above --tis-clip {cfg.tis_clip}")
    resolve_aggregation(cfg)


def discounted_reverse_cumsum(x: Tensor, discount: float) -> Tensor:
    """y[:, t] = Σ_{k>=t} discount^(k−t) x[:, k] over the last dim of [B, L], as a chunked scan.

    Equivalent to the backward loop y_t = x_t + discount·y_{t+1}, with L/128 matmuls instead of L
    Python steps; powers never exceed the chunk length, so nothing underflows across a long sequence.
    """
    batch, length = x.shape
    out = torch.empty_like(x)
    carry = torch.zeros(batch, dtype=x.dtype, device=x.device)
    steps = torch.arange(_SCAN_CHUNK, device=x.device, dtype=x.dtype)
    exps = steps[:, None] - steps[None, :]  # exps[k, t] = k − t
    base = torch.full((), discount, dtype=x.dtype, device=x.device)
    weights = torch.where(exps >= 0, torch.pow(base, exps.clamp(min=0)), 0.0)  # weights[k, t] = discount^(k−t)
    for end in range(length, 0, -_SCAN_CHUNK):
        start = max(0, end - _SCAN_CHUNK)
        n = end - start
        carry_pow = torch.pow(base, n - steps[:n])  # discount^(end − t) for the value carried from `end`
        out[:, start:end] = x[:, start:end] @ weights[:n, :n] + carry[:, None] * carry_pow[None, :]
        carry = out[:, start]
    return out


def _pack_positions(response_lengths: list[int], keep: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """(rows, cols, counts, width) placing the kept tokens of each sample left-aligned in a [B, width] grid."""
    seg = segment_ids(response_lengths, keep.device)
    keep_long = keep.long()
    counts = segment_sum(keep_long, response_lengths)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.cumsum(keep_long, 0) - keep_long - starts[seg]
    width = int(counts.max().item()) if len(response_lengths) else 0
    return seg[keep], rank[keep], counts, width


def _grid(values: Tensor, rows: Tensor, cols: Tensor, batch: int, width: int) -> Tensor:
    out = torch.zeros(batch, width, dtype=values.dtype, device=values.device)
    out[rows, cols] = values
    return out


def _reinforce_plus_plus_returns(
    rewards: Tensor, token_kl: Tensor, keep: Tensor, response_lengths: list[int], *, kl_coef: float, gamma: float
) -> Tensor:
    token_rewards = torch.where(keep, -kl_coef * token_kl, torch.zeros_like(token_kl))
    everything = torch.ones_like(keep)
    rows, cols, _, width = _pack_positions(response_lengths, everything)
    if width == 0:
        return torch.zeros_like(token_rewards)
    grid = _grid(token_rewards, rows, cols, len(response_lengths), width)
    # The raw reward lands on the last token that is trained on (the final tokens may be tool output).
    keep_grid = _grid(keep.float(), rows, cols, len(response_lengths), width)
    has_trainable = keep_grid.any(dim=1)
    last = width - 1 - keep_grid.flip(1).argmax(dim=1)  # argmax returns the first maximum
    idx = torch.nonzero(has_trainable).squeeze(1)
    grid[idx, last[idx]] += rewards[idx]
    returns = discounted_reverse_cumsum(grid, gamma)[rows, cols]
    return torch.where(keep, returns, torch.zeros_like(returns))


def _gae(
    rewards: Tensor, values: Tensor, keep: Tensor, response_lengths: list[int], *, gamma: float, lambd: float
) -> tuple[Tensor, Tensor]:
    rows, cols, counts, width = _pack_positions(response_lengths, keep)
    batch = len(response_lengths)
    value_grid = _grid(values.float()[keep], rows, cols, batch, width)
    reward_grid = torch.zeros_like(value_grid)
    idx = torch.nonzero(counts > 0).squeeze(1)
    reward_grid[idx, counts[idx] - 1] = rewards[idx]
    # Grid padding holds V = 0, which is exactly the terminal bootstrap after the last trainable step.
    next_values = torch.cat([value_grid[:, 1:], torch.zeros_like(value_grid[:, :1])], dim=1)
    deltas = reward_grid + gamma * next_values - value_grid
    adv_grid = discounted_reverse_cumsum(deltas, gamma * lambd)
    advantages = torch.zeros_like(values, dtype=torch.float32)
    returns = torch.zeros_like(advantages)
    advantages[keep] = adv_grid[rows, cols]
    returns[keep] = (adv_grid + value_grid)[rows, cols]
    return advantages, returns


def _reward_kl(cfg: AlgoConfig, log_probs: Tensor | None, ref_log_probs: Tensor | None, like: Tensor) -> Tensor:
    """Per-token KL for reward shaping (reinforce_plus_plus*), zero when --kl-coef is 0."""
    if cfg.kl_coef == 0:
        return torch.zeros_like(like, dtype=torch.float32)
    if log_probs is None or ref_log_probs is None:
        raise ValueError(f"--kl-coef {cfg.kl_coef} needs log_probs and ref_log_probs (a reference model, --ref-load)")
    return compute_approx_kl(log_probs.detach(), ref_log_probs.detach(), cfg.kl_loss_type)


@torch.no_grad()
def compute_advantages_and_returns(
    cfg: AlgoConfig,
    *,
    rewards: Tensor,
    response_lengths: list[int],
    loss_mask: Tensor,
    log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    values: Tensor | None = None,
    teacher_log_probs: Tensor | None = None,
    opd_reverse_kl: Tensor | None = None,
    dp_group=None,
) -> tuple[Tensor, Tensor]:
    """(advantages[T], returns[T]) in fp32. `rewards` is [B]; every other tensor is per-token [T].

    Returns are the estimator's (critic targets for ppo): before the OPD penalty and whitening.

    With --normalize-advantages this is a collective over `dp_group` (default world) when
    torch.distributed is initialised: every DP rank must call it.
    """
    check_algo_config(cfg)
    _check_shapes(rewards, response_lengths, loss_mask)
    # Rewards often come straight from the CPU-side batch; the per-token tensors live on the device.
    rewards = rewards.to(device=loss_mask.device, dtype=torch.float32)
    keep = loss_mask != 0
    zeros = torch.zeros(sum(response_lengths), dtype=torch.float32, device=loss_mask.device)
    advantages, returns = _estimate(cfg, rewards, response_lengths, keep, zeros, log_probs, ref_log_probs, values)
    if cfg.use_opd:
        penalised = apply_opd(
            advantages,
            student_log_probs=log_probs,
            teacher_log_probs=teacher_log_probs,
            opd_reverse_kl=opd_reverse_kl,
            coef=cfg.opd_kl_coef,
        )
        advantages = torch.where(keep, penalised, zeros)
    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, loss_mask, group=dp_group)
    return advantages, returns


def _check_shapes(rewards: Tensor, response_lengths: list[int], loss_mask: Tensor) -> None:
    num_tokens = sum(response_lengths)
    if rewards.shape != (len(response_lengths),):
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}, expected ({len(response_lengths)},): one per sample"
        )
    if loss_mask.shape != (num_tokens,):
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)}, expected ({num_tokens},) = sum(response_lengths)"
        )


def _estimate(
    cfg: AlgoConfig,
    rewards: Tensor,
    response_lengths: list[int],
    keep: Tensor,
    zeros: Tensor,
    log_probs: Tensor | None,
    ref_log_probs: Tensor | None,
    values: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The estimator's (advantages, returns) per token: 0 where `keep` is False."""
    estimator = cfg.advantage_estimator
    if estimator in ("grpo", "gspo"):
        advantages = torch.where(keep, broadcast_to_tokens(rewards, response_lengths), zeros)
        return advantages, advantages
    if estimator == "reinforce_plus_plus_baseline":
        token_kl = _reward_kl(cfg, log_probs, ref_log_probs, zeros)
        shaped = broadcast_to_tokens(rewards, response_lengths) - cfg.kl_coef * token_kl
        advantages = torch.where(keep, shaped, zeros)
        return advantages, advantages
    if estimator == "reinforce_plus_plus":
        token_kl = _reward_kl(cfg, log_probs, ref_log_probs, zeros)
        advantages = _reinforce_plus_plus_returns(
            rewards, token_kl, keep, response_lengths, kl_coef=cfg.kl_coef, gamma=cfg.gamma
        )
        return advantages, advantages
    # ppo
    if values is None:
        raise ValueError("--advantage-estimator ppo needs per-token critic values; none were given")
    return _gae(rewards, values, keep, response_lengths, gamma=cfg.gamma, lambd=cfg.lambd)
