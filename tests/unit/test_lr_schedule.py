"""LR schedule values against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from miles.trainer.lr_schedule import LRSchedule, LRScheduler


def test_warmup_then_constant():
    s = LRSchedule(lr=1.0, warmup_iters=4)
    assert [s.lr_at(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_to_min():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_style="linear", decay_iters=6)
    # after warm-up: frac = (step-2)/4 -> lr = 0.1 + 0.9 * (1 - frac)
    assert [round(s.lr_at(i), 6) for i in range(8)] == [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]


def test_cosine_decay():
    s = LRSchedule(lr=2.0, min_lr=0.0, decay_style="cosine", decay_iters=4)
    assert s.lr_at(0) == pytest.approx(2.0)
    assert s.lr_at(2) == pytest.approx(1.0)  # half way: cos(pi/2) = 0
    assert s.lr_at(1) == pytest.approx(1.0 + math.cos(math.pi / 4))
    assert s.lr_at(4) == pytest.approx(0.0) and s.lr_at(9) == pytest.approx(0.0)


def test_validation_messages():
    with pytest.raises(ValueError, match="lr-decay-iters"):
        LRSchedule(lr=1.0, decay_style="cosine")
    with pytest.raises(ValueError, match="lr_decay_style='exp'"):
        LRSchedule(lr=1.0, decay_style="exp")


def test_scheduler_sets_optimizer_lr_and_restores():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=123.0)
    sched = LRScheduler(opt, LRSchedule(lr=1.0, warmup_iters=4))
    assert opt.param_groups[0]["lr"] == 0.25
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.75
    other = LRScheduler(torch.optim.SGD([p], lr=5.0), LRSchedule(lr=1.0, warmup_iters=4))
    other.load_state_dict(sched.state_dict())
    assert other.optimizer.param_groups[0]["lr"] == 0.75 and other.current_lr == 0.75
