"""The objective's flags that exclude or need each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_algo(cfg: MilesConfig) -> list[str]:
    e: list[str] = []
    a = cfg.algo
    if a.advantage_estimator.startswith("reinforce_plus_plus") and not a.normalize_advantages:
        e.append(f"--advantage-estimator={a.advantage_estimator} needs --normalize-advantages")
    if a.use_rollout_logprobs and a.use_tis:
        e.append(
            "--use-rollout-logprobs and --use-tis exclude each other (TIS corrects the rollout log-probs); drop one"
        )
    if a.kl_coef != 0 and a.kl_loss_coef != 0:
        e.append(
            f"--kl-coef={a.kl_coef} (KL in the reward) and --kl-loss-coef={a.kl_loss_coef} (KL loss) are both non-zero; keep one"
        )
    if a.advantage_estimator == "ppo" and a.kl_coef != 0:
        e.append(
            f"--advantage-estimator=ppo does not take --kl-coef={a.kl_coef}; use --use-kl-loss --kl-loss-coef instead"
        )
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        e.append(f"--eps-clip-c={a.eps_clip_c} must be greater than 1 (dual-clip bound), e.g. 3.0")
    if a.calculate_per_token_loss and a.loss_aggregation != "token_mean":
        e.append(f"--calculate-per-token-loss means token_mean, but --loss-aggregation={a.loss_aggregation}; drop one")
    if a.loss_type == "custom_loss" and not a.custom_loss_function_path:
        e.append("--loss-type=custom_loss needs --custom-loss-function-path")
    if cfg.reward.group_rm and not cfg.reward.custom_rm_path:
        e.append("--group-rm scores groups with --custom-rm-path; set --custom-rm-path")
    return e
