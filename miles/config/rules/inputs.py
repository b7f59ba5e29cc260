"""What a training run cannot start without."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_train_inputs(cfg: MilesConfig) -> list[str]:
    """What a training run cannot start without."""
    e: list[str] = []
    if not cfg.model.hf_checkpoint:
        e.append("--hf-checkpoint is required (HF model directory for the engines and the trainer)")
    if not cfg.data.prompt_data and not cfg.data.data_source_path:
        e.append("--prompt-data is required (JSONL of prompts), or --data-source-path for a custom source")
    rw = cfg.reward
    has_reward = rw.rm_type or rw.custom_rm_path or rw.group_reward_path or cfg.rollout.rollout_function_path
    if not has_reward and cfg.algo.loss_type != "sft_loss":
        e.append("no reward: set --rm-type (e.g. math) or --custom-rm-path pkg.module:fn")
    if cfg.rollout.rollout_batch_size is None:
        e.append("--rollout-batch-size is required (prompt groups per rollout step), or --global-batch-size")
    if cfg.rollout.num_rollout is None and cfg.data.num_epoch is None:
        e.append("give --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data)")
    return e
