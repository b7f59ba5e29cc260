"""Defaults that depend on flags of other sections (a section's own derived values are its `derive()`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def apply_derivations(cfg: MilesConfig, explicit: set[str]) -> None:
    """Fill every unset value that follows from others; explicit values stay."""
    r, a, t = cfg.rollout, cfg.algo, cfg.train
    for section in (r, a, t, cfg.runtime):
        section.derive()
    if t.true_on_policy_mode and a.loss_type != "sft_loss" and not r.rollout_function_path:
        r.recompute_logprobs_via_prefill = True  # the rollout's log-probs come from the reference forward
    if r.n_samples_per_prompt == 1 and not a.disable_grpo_std_normalization:
        a.disable_grpo_std_normalization = True  # the std of a single sample is 0
    if r.rollout_submission_granularity is None:
        r.rollout_submission_granularity = "sample" if cfg.async_.fully_async else "group"
    if not cfg.engine.colocate:  # colocated, None stays: decided from the GPUs' memory once both sides are up
        t.offload_train = bool(t.offload_train)
        t.offload_rollout = bool(t.offload_rollout)
    if cfg.model.ref_load is None and (a.use_kl_loss or a.kl_coef != 0):
        cfg.model.ref_load = cfg.model.hf_checkpoint
    if a.advantage_estimator == "ppo" and cfg.model.critic_load is None:
        cfg.model.critic_load = cfg.model.hf_checkpoint
    if cfg.data.rollout_max_prompt_len is None and r.rollout_max_context_len is not None:
        cfg.data.rollout_max_prompt_len = r.rollout_max_context_len - 1
    if "use_tis" not in explicit and not a.use_rollout_logprobs and fp8_serving(cfg):
        a.use_tis = True  # FP8 rollouts of a bf16 policy: TIS absorbs the mismatch (--no-use-tis opts out)


def fp8_serving(cfg: MilesConfig) -> str | None:
    """What makes the engines serve FP8 (`--sglang-quantization fp8`, or an FP8 rollout checkpoint), for a
    message; None when they serve the model's own dtype."""
    if cfg.engine.sglang_args.get("quantization") == "fp8":
        return "--sglang-quantization fp8"
    return f"the FP8 checkpoint {cfg.model.hf_checkpoint}" if serves_fp8(cfg.model.hf_checkpoint) else None


def serves_fp8(checkpoint: str | None) -> bool:
    """Whether the engines' checkpoint is an FP8 rollout checkpoint (its config.json's quantization_config)."""
    path = os.path.join(checkpoint, "config.json") if checkpoint else ""
    if not path or not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return quant.get("quant_method") == "fp8"
