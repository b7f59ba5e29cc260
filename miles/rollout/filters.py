"""Group filters for dynamic sampling (`--dynamic-sampling-filter-path`).

A filter sees one finished group and says whether it is worth training on. Built in:
`check_reward_nonzero_std` (a group whose rewards are all equal has zero advantage under group
normalisation, so it carries no gradient signal) and `check_no_aborted`. A custom filter may
return `DynamicFilterOutput` or a bare bool; `apply_filter` accepts both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value

logger = logging.getLogger(__name__)

_STD_EPS = 1e-8


@dataclass(slots=True)
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


def _flatten(group: Iterable[Sample | list[Sample]]) -> list[Sample]:
    """Samples of a group whose members may themselves be lists (multi-segment trajectories)."""
    out: list[Sample] = []
    for item in group:
        out.extend(item if isinstance(item, list) else [item])
    return out


def check_reward_nonzero_std(args: Any, group: list[Sample], **kw: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (unbiased std > 1e-8); reason `zero_std_<reward>` otherwise."""
    samples = _flatten(group)
    if not samples:
        return DynamicFilterOutput(keep=False, reason="empty_group")
    rewards = np.array([reward_value(s, getattr(args, "reward_key", None)) for s in samples], dtype=np.float64)
    if len(rewards) > 1 and rewards.std(ddof=1) > _STD_EPS:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(float(rewards[0]), 1)}")


def check_no_aborted(args: Any, group: list[Sample], **kw: Any) -> DynamicFilterOutput:
    """Drop a group in which any sample was aborted."""
    if any(s.status == SampleStatus.ABORTED for s in _flatten(group)):
        return DynamicFilterOutput(keep=False, reason="aborted")
    return DynamicFilterOutput(keep=True)


def apply_filter(fn: Callable[..., Any], args: Any, group: list[Sample], **kw: Any) -> DynamicFilterOutput:
    """Run a filter and normalise its result (bare bools are accepted)."""
    result = fn(args, group, **kw)
    if isinstance(result, DynamicFilterOutput):
        return result
    if isinstance(result, (bool, np.bool_)):
        return DynamicFilterOutput(keep=bool(result), reason=None if result else "filtered")
    keep = getattr(result, "keep", None)
    if isinstance(keep, (bool, np.bool_)):  # a look-alike record from a plug-in package
        return DynamicFilterOutput(keep=bool(keep), reason=getattr(result, "reason", None))
    name = getattr(fn, "__qualname__", repr(fn))
    raise TypeError(
        f"dynamic sampling filter {name} returned {type(result).__name__}; return a bool or DynamicFilterOutput"
    )
