"""--fp32-residual-connection: where the trainer cannot keep its residual stream in fp32 as asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_fp32_residual(cfg: MilesConfig) -> list[str]:
    """The FSDP trainer keeps an fp32 stream by hooks on a transformers decoder; the true-on-policy mode scores
    both sides with one reference forward, which these hooks would leave on the trainer's side only."""
    if cfg.train.fp32_residual_connection and cfg.train.true_on_policy_mode:
        return [
            "--fp32-residual-connection with --true-on-policy-mode: the mode scores the engine's samples and the "
            "trainer's with one reference forward, whose stream must be the same on both sides; drop one"
        ]
    return []
