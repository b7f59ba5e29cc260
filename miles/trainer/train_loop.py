"""One RL step on this rank's shard, for any backend (through the `TrainBackend` protocol only).

Order (as in Miles): ref log-probs (KL terms) -> old log-probs (unless --use-rollout-logprobs)
-> values (PPO) -> advantages/returns (collective over DP) -> `num_steps_per_rollout` optimizer
steps, each over `global_batch_size / dp` consecutive samples of the shard. Each step fixes its
loss denominators over all DP ranks first, so micro-batch losses sum to the step objective; the
backend runs the micro-batches (its own schedule, e.g. a pipeline's) and calls back into the
loss built here for each one.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from miles.algo.advantages import compute_advantages_and_returns
from miles.algo.aggregation import StepDenominators
from miles.algo.losses import LossInputs, get_loss_function, value_loss
from miles.errors import NonFiniteTraining
from miles.rollout.train_data import TrainBatch
from miles.trainer.backend import MicroBatchLoss, TrainBackend
from miles.trainer.forward import token_index
from miles.utils.peak_memory import PREFIX as PEAK_PREFIX
from miles.utils.peak_memory import phase_peak

logger = logging.getLogger(__name__)

_PER_TOKEN_KEYS = (
    "loss_mask",
    "old_log_probs",
    "rollout_log_probs",
    "ref_log_probs",
    "advantages",
    "returns",
    "old_values",
    "teacher_log_probs",
    "opd_reverse_kl",
)


def steps_per_rollout(num_local: int, global_batch_size: int | None, dp_size: int, expected: int | None) -> int:
    """Optimizer steps for a shard of `num_local` samples; checks the four-knob arithmetic."""
    if global_batch_size is None:
        return 1
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; "
            f"pick a multiple of {dp_size}"
        )
    per_rank = global_batch_size // dp_size
    if num_local % per_rank:
        raise ValueError(
            f"this rank got {num_local} samples, not a multiple of global_batch_size/dp = {per_rank}; "
            "the controller must shard whole optimizer steps to every rank"
        )
    n = num_local // per_rank
    if expected is not None and expected != n:
        raise ValueError(f"num_steps_per_rollout={expected} but the shard holds {n} steps of {per_rank} samples")
    return n


def _f32(x: np.ndarray | None) -> torch.Tensor | None:
    """A float32 tensor over a writable copy of `x` (arrays off the wire are read-only); None stays None."""
    return None if x is None else torch.from_numpy(np.array(x, dtype=np.float32))


def _per_token_tensors(batch: TrainBatch, **cols: np.ndarray | None) -> dict[str, torch.Tensor]:
    out = {"loss_mask": _f32(batch.loss_masks)}
    out.update((key, _f32(value)) for key, value in cols.items() if value is not None)
    return out


def _token_mean(x: np.ndarray, mask: np.ndarray, be: TrainBackend) -> float:
    """Masked token mean over all DP ranks."""
    t = torch.tensor([float((x * mask).sum()), float(mask.sum())], dtype=torch.float64, device=be.device)
    dist.all_reduce(t, group=be.dp_group)
    return float(t[0] / t[1].clamp(min=1.0))


def run_rl_step(be: TrainBackend, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
    algo = be.algo
    n_steps = steps_per_rollout(len(batch), be.rollout.global_batch_size, be.dp_size, be.rollout.num_steps_per_rollout)
    mask = batch.loss_masks.astype(np.float32)
    metrics: dict[str, float] = {}
    t_phase = be.now()
    with phase_peak(be.device, "log_probs", metrics):
        ref_lp = be.compute_log_probs(batch, "ref")[0] if be.has_ref else None
    metrics["perf/train/ref_log_probs_time"] = be.now() - t_phase
    t_phase = be.now()
    fused_old = old_log_probs_in_update(be, batch, n_steps)
    with phase_peak(be.device, "log_probs", metrics):
        old_lp = _old_log_probs(be, batch, fused_old, mask, metrics)
    metrics["perf/train/actor_log_probs_time"] = be.now() - t_phase
    if ref_lp is not None and old_lp is not None:
        metrics["train/ref_kl"] = _token_mean(old_lp - ref_lp, mask, be)
    values = be.compute_values(batch) if be.has_critic else None

    advantages, returns = compute_advantages_and_returns(
        algo,
        rewards=_f32(batch.rewards),
        response_lengths=[int(x) for x in batch.response_lengths],
        loss_mask=_f32(mask),
        log_probs=_f32(old_lp),
        ref_log_probs=_f32(ref_lp),
        values=_f32(values),
        teacher_log_probs=_f32(batch.teacher_log_probs),
        opd_reverse_kl=_f32(batch.opd_reverse_kl),
        dp_group=be.dp_group,
    )
    per_token = _per_token_tensors(
        batch,
        old_log_probs=old_lp,
        rollout_log_probs=batch.rollout_log_probs,
        ref_log_probs=ref_lp,
        advantages=advantages.cpu().numpy(),
        returns=returns.cpu().numpy(),
        old_values=values,
        teacher_log_probs=batch.teacher_log_probs,
        opd_reverse_kl=batch.opd_reverse_kl,
    )
    _optimizer_steps(be, batch, per_token, rollout_id, n_steps, fused_old, metrics)
    phases = [v for k, v in metrics.items() if k.startswith(PEAK_PREFIX)]  # CUDA: reset per phase
    metrics["perf/peak_mem_gb"] = max(phases) if phases else be.peak_mem_gb()
    metrics["train/lr"] = be.current_lr()
    return metrics


def _optimizer_steps(
    be: TrainBackend,
    batch: TrainBatch,
    per_token: dict[str, np.ndarray],
    rollout_id: int,
    n_steps: int,
    fused_old: bool,
    metrics: dict[str, float],
) -> None:
    """The `n_steps` optimizer steps over consecutive slices of the shard (critic first, then the actor
    unless still in --num-critic-only-steps); their mean losses, time and throughput go into `metrics`."""
    train_actor = rollout_id >= be.train_cfg.num_critic_only_steps or not be.has_critic
    per_rank = len(batch) // n_steps
    sums: dict[str, float] = defaultdict(float)
    tokens, t0 = 0, be.now()
    with phase_peak(be.device, "update", metrics):  # the optimizer steps, old log-probs fused or not
        for step in range(n_steps):
            where = f"step {rollout_id} (optimizer step {step + 1} of {n_steps})"
            idx = list(range(step * per_rank, (step + 1) * per_rank))
            step_batch = batch.select(idx)
            pos = _as_index(token_index(batch.response_lengths, idx))
            step_tok = {k: v[pos] for k, v in per_token.items()}
            if be.has_critic:
                for k, v in _optimizer_step(be, step_batch, step_tok, critic=True, where=where).items():
                    sums[f"train/{k}" if k.startswith("value") else f"train/critic_{k}"] += v
            if train_actor:
                for k, v in _optimizer_step(
                    be, step_batch, step_tok, critic=False, where=where, fused_old=fused_old
                ).items():
                    sums[f"train/{k}"] += v
            tokens += step_batch.num_tokens
    elapsed = be.now() - t0
    metrics["perf/train/update_time"] = elapsed
    metrics.update({k: v / n_steps for k, v in sums.items()})
    total_tokens = _sum_over_ranks(float(tokens), be)
    metrics["perf/train_tokens_per_s"] = total_tokens / max(elapsed, 1e-9)


def _old_log_probs(
    be: TrainBackend, batch: TrainBatch, fused_old: bool, mask: np.ndarray, metrics: dict[str, float]
) -> np.ndarray | None:
    """The old policy's per-token log-probs: the engine's (--use-rollout-logprobs), none (SFT, or fused into
    the update), or a forward pass of the actor (which also gives `train/entropy`)."""
    if be.algo.use_rollout_logprobs:
        if batch.rollout_log_probs is None:
            raise ValueError(
                "--use-rollout-logprobs needs rollout_log_probs in the TrainBatch; the engine returned none"
            )
        return batch.rollout_log_probs.astype(np.float32)
    if be.algo.loss_type == "sft_loss" or fused_old:
        return None  # the SFT loss needs no old policy; fused: taken from the update's own forward
    old_lp, entropy = be.compute_log_probs(batch, "actor")
    metrics["train/entropy"] = _token_mean(entropy, mask, be)
    return old_lp


def old_log_probs_in_update(be: TrainBackend, batch: TrainBatch, n_steps: int) -> bool:
    """The old policy's log-probs come from the update's own forward, with no pass of their own.

    With one optimizer step per rollout the weights do not change between the old-log-prob pass
    and the update's forwards, so both compute the same quantity: the update detaches its own
    log-probs instead (ratio 1, as the separate pass gives up to rounding). This holds only when
    nothing needs them before the update: no KL to a reference, no critic, no teacher.
    """
    return (
        n_steps == 1
        and not be.algo.use_rollout_logprobs
        and be.algo.loss_type != "sft_loss"
        and not be.has_ref
        and not be.has_critic
        and batch.teacher_log_probs is None
    )


def _as_index(pos: slice | np.ndarray) -> slice | torch.Tensor:
    return pos if isinstance(pos, slice) else torch.from_numpy(pos)


def _sum_over_ranks(x: float, be: TrainBackend) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=be.device)
    dist.all_reduce(t, group=be.dp_group)
    return float(t.item())


def _step_denominators(step_batch: TrainBatch, be: TrainBackend) -> StepDenominators:
    t = torch.tensor([len(step_batch), float(step_batch.loss_masks.sum())], dtype=torch.float64, device=be.device)
    dist.all_reduce(t, group=be.dp_group)
    return StepDenominators(num_samples=int(t[0].item()), num_tokens=int(round(t[1].item())))


def _optimizer_step(
    be: TrainBackend,
    step_batch: TrainBatch,
    step_tok: dict[str, torch.Tensor],
    *,
    critic: bool,
    where: str,
    fused_old: bool = False,
) -> dict[str, float]:
    """Forward/backward over micro-batches, clip, optimizer step, LR schedule step; returns summed metrics.

    fused_old: the old log-probs are this forward's own, detached (`old_log_probs_in_update`); the
    token mean of the entropy is reported as `entropy`, as the separate pass would.

    A non-finite loss or grad norm raises NonFiniteTraining before the optimizer step, on every
    rank alike (both are reduced over ranks), so the weights stay as they were.
    """
    den = _step_denominators(step_batch, be)
    if be.algo.entropy_coef != 0.0:
        entropy_mode = "grad"
    else:  # SFT reports no entropy; skip the extra pass over the logits
        entropy_mode = "none" if be.algo.loss_type == "sft_loss" else "detached"
    loss_fn = _micro_batch_loss(be, step_batch, step_tok, den, critic=critic, fused_old=fused_old)
    sums = be.forward_backward(step_batch, loss_fn, critic=critic, entropy=entropy_mode)
    grad_norm = be.clip_grad_norm(critic=critic)
    out = _reduce_metrics(sums, be)
    out["grad_norm"] = grad_norm
    try:
        _refuse_non_finite(out, "critic" if critic else "actor", where)
    except NonFiniteTraining:
        be.zero_grad(critic=critic)
        raise
    be.optimizer_step(critic=critic)
    return out


def _micro_batch_loss(
    be: TrainBackend,
    step_batch: TrainBatch,
    step_tok: dict[str, torch.Tensor],
    den: StepDenominators,
    *,
    critic: bool,
    fused_old: bool = False,
) -> MicroBatchLoss:
    """The loss of one micro-batch of `step_batch`, from the backend's log-probs (or values) for it."""
    algo = be.algo
    policy_loss = None if critic else get_loss_function(algo)

    def loss_of(
        sample_idx: list[int], out: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pos = _as_index(token_index(step_batch.response_lengths, sample_idx))
        tok = {k: v[pos].to(out.device, non_blocking=True) for k, v in step_tok.items()}
        lengths = [int(step_batch.response_lengths[i]) for i in sample_idx]
        if critic:
            inp = LossInputs(
                log_probs=out.detach(),
                loss_mask=tok["loss_mask"],
                response_lengths=lengths,
                den=den,
                values=out,
                old_values=tok.get("old_values"),
                returns=tok.get("returns"),
            )
            return value_loss(algo, inp)
        inp = LossInputs(
            log_probs=out,
            loss_mask=tok["loss_mask"],
            response_lengths=lengths,
            den=den,
            old_log_probs=out.detach() if fused_old else tok.get("old_log_probs"),
            advantages=tok.get("advantages"),
            rollout_log_probs=tok.get("rollout_log_probs"),
            ref_log_probs=tok.get("ref_log_probs"),
            entropy=entropy,
            teacher_log_probs=tok.get("teacher_log_probs"),
            opd_reverse_kl=tok.get("opd_reverse_kl"),
        )
        loss, parts = policy_loss(algo, inp)
        if fused_old and entropy is not None:
            parts["entropy"] = (entropy.detach().float() * tok["loss_mask"]).sum() / max(den.num_tokens, 1)
        return loss, parts

    return loss_of


def _refuse_non_finite(metrics: dict[str, float], model_name: str, where: str) -> None:
    bad = {k: v for k, v in metrics.items() if (k == "grad_norm" or k.endswith("loss")) and not math.isfinite(v)}
    if not bad:
        return
    shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
    raise NonFiniteTraining(
        f"{where}: the {model_name} has {shown}; the update was not applied and this step is not saved. "
        "Look for rewards of extreme size (rollout/reward_mean; --disable-rewards-normalization passes them "
        "through), a too high --lr, or a custom loss"
    )


def _reduce_metrics(sums: dict[str, torch.Tensor], be: TrainBackend) -> dict[str, float]:
    """Sum metric contributions over ranks; every rank must hold the same keys (checked by a digest)."""
    keys = sorted(sums)
    digest = float(zlib.crc32("\n".join(keys).encode()))
    check = torch.tensor([digest, -digest], dtype=torch.float64, device=be.device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=be.dp_group)
    if check[0].item() != -check[1].item():
        raise RuntimeError(
            f"loss metrics differ across DP ranks (this rank: {keys}); the loss function must return "
            "the same metric keys on every rank"
        )
    if not keys:
        return {}
    t = torch.stack([sums[k].to(device=be.device, dtype=torch.float64) for k in keys])
    dist.all_reduce(t, group=be.dp_group)
    return dict(zip(keys, t.tolist(), strict=True))
