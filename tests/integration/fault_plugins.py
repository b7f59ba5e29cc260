"""Faulty plug-ins for test_faults.py, loaded by `miles train` by import path (`fault_plugins:...`)."""

from __future__ import annotations

from miles.controller import drop_guard
from miles.recipes.digit_copy import first_digit_reward

# The `*_late` plug-ins misbehave from this sample index on (steps 0 and 1 are clean).
LATE_FROM_INDEX = 32  # the first sample of step 2 with 4 groups of 4 per step


async def none_reward(args, sample, **kw):
    return None


def reject_every_group(args, group, **kw) -> bool:
    return False


async def nan_or_string_reward(args, sample, **kw):
    """NaN for samples 0 mod 16, the string "1.0" for 1 mod 16 (every 4th group of 4, group 0 first)."""
    if sample.index % 16 == 0:
        return float("nan")
    if sample.index % 16 == 1:
        return "1.0"
    return first_digit_reward(sample.response, sample.label)


async def huge_reward_late(args, sample, **kw):
    """The demo reward, then 3e38 (finite, but its token sum overflows float32) from LATE_FROM_INDEX on."""
    if sample.index is not None and sample.index >= LATE_FROM_INDEX:
        return 3e38
    return first_digit_reward(sample.response, sample.label)


async def none_reward_late(args, sample, **kw):
    """The demo reward for the first two steps of 16 samples, then None for ever.

    The test waits for the stalled rollout's progress line: what it checks is that the line comes while
    the drops pile up, not its 5 s period, so this run logs it every 0.5 s (this plug-in runs in the
    controller, where the guard reads the period)."""
    drop_guard.LOG_EVERY_S = 0.5
    if sample.index is not None and sample.index >= LATE_FROM_INDEX:
        return None
    return first_digit_reward(sample.response, sample.label)
