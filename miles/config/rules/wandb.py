"""Weights & Biases: --use-wandb needs a project, and the W&B settings need --use-wandb."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_wandb(cfg: MilesConfig) -> list[str]:
    e, log = [], cfg.logging
    if log.use_wandb and not log.wandb_project:
        e.append("--use-wandb needs --wandb-project NAME (the W&B project the run logs to)")
    unused = [
        f
        for f, v in (
            ("--wandb-project", log.wandb_project),
            ("--wandb-group", log.wandb_group),
            ("--wandb-mode", log.wandb_mode),
        )
        if v is not None
    ]
    if unused and not log.use_wandb:
        e.append(f"{', '.join(unused)} without --use-wandb logs nothing to W&B; add --use-wandb or drop them")
    return e
