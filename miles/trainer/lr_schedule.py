"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to `min_lr`.

Step s counts optimizer steps already taken (0 for the first step). Warm-up ramps linearly so
the first step uses lr/warmup and step warmup-1 uses the full lr; decay runs from the end of
warm-up to `decay_iters`, after which the rate stays at `min_lr`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(slots=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_style: str = "constant"
    decay_iters: int | None = None

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style={self.decay_style!r} is not one of {DECAY_STYLES}")
        if self.warmup_iters < 0:
            raise ValueError(f"lr_warmup_iters={self.warmup_iters} must be >= 0")
        if self.decay_style != "constant" and self.decay_iters is None:
            raise ValueError(
                f"lr_decay_style={self.decay_style!r} needs --lr-decay-iters (decay horizon in optimizer steps)"
            )
        if self.decay_iters is not None and self.decay_iters < self.warmup_iters:
            raise ValueError(
                f"lr_decay_iters={self.decay_iters} < lr_warmup_iters={self.warmup_iters}; "
                "the decay horizon must include the warm-up"
            )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        assert self.decay_iters is not None
        span = self.decay_iters - self.warmup_iters
        frac = 1.0 if span <= 0 else min(1.0, (step - self.warmup_iters) / span)
        if self.decay_style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + (self.lr - self.min_lr) * coeff


class LRScheduler:
    """Sets the optimizer's lr for the step about to be taken; checkpointed as `{"step": n}`."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.step_count = 0
        self._apply()

    @property
    def current_lr(self) -> float:
        return self.schedule.lr_at(self.step_count)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step"])
        self._apply()
