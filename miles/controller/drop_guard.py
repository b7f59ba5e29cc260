"""Bounded retries: generation that drops every group stops the run with one clear error.

A group is dropped when a sample was aborted, its reward failed (an exception, None, a string,
NaN...) or the dynamic filter rejected it; its prompt is retried or discarded. That is right when
some groups drop, and an endless loop when all do: a reward that returns None, a filter that
rejects everything, a dead reward server. `DropGuard` counts the groups dropped since the last
accepted one. While they pile up it logs a line every few seconds; past
`--rollout-max-consecutive-drops` it raises `RolloutStalled` with the reasons, the plug-in behind
them and the first error seen.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from miles.config import RolloutConfig
from miles.errors import RolloutStalled
from miles.rollout.rm_hub import reward_source
from miles.rollout.sample import Sample

logger = logging.getLogger(__name__)

LOG_EVERY_S = 5.0
DEFAULT_LIMIT_REFILLS = 16  # the default limit, in refills' worth of groups (16 x --over-sampling-batch-size)


def max_consecutive_drops(rollout_cfg: RolloutConfig) -> int:
    """`--rollout-max-consecutive-drops`, or 16 x the groups one refill submits."""
    if rollout_cfg.rollout_max_consecutive_drops:
        return rollout_cfg.rollout_max_consecutive_drops
    per_refill = rollout_cfg.over_sampling_batch_size or rollout_cfg.rollout_batch_size or 1
    return DEFAULT_LIMIT_REFILLS * per_refill


class DropGuard:
    """Counts consecutive dropped groups; logs while they pile up, raises once they reach `limit`."""

    def __init__(self, limit: int, *, target: int | None, args: Any, where: str) -> None:
        self.limit = limit
        self.target = target  # groups one step needs; None: the guard spans the run (fully async)
        self.args = args
        self.where = where  # "rollout 3", "fully async generation"
        self.accepted = 0
        self._reset()

    def _reset(self) -> None:
        self.run_length = 0
        self.samples = 0
        self.reasons: Counter[str] = Counter()
        self.first_error: str | None = None
        self._last_log = time.monotonic()

    def accept(self) -> None:
        self.accepted += 1
        self._reset()

    def drop(self, group: list[Sample], reason: str) -> None:
        """Record a dropped group (before its samples are reset); raises RolloutStalled at the limit."""
        self.run_length += 1
        self.samples += len(group)
        self.reasons[reason] += 1
        if self.first_error is None:
            self.first_error = next((s.metadata["reward_error"] for s in group if "reward_error" in s.metadata), None)
        if self.run_length >= self.limit:
            raise RolloutStalled(self.message())
        now = time.monotonic()
        piling_up = self.run_length >= min(self.target or self.limit, self.limit // 2)
        if piling_up and now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.warning(
                "%s: the last %d groups were all dropped (%s); %s; retrying, and stopping after %d in a row",
                self.where,
                self.run_length,
                self._reasons(),
                self._accepted(),
                self.limit,
            )

    def _accepted(self) -> str:
        if self.target is None:
            return f"{self.accepted} groups accepted before them"
        return f"{self.accepted} of {self.target} groups accepted"

    def _reasons(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.reasons.most_common())

    def message(self) -> str:
        return (
            f"{self.where}: the last {self.run_length} groups ({self.samples} samples) were all dropped "
            f"({self._reasons()}); {self._accepted()}. {self._cause()}. Fix that, "
            f"or raise --rollout-max-consecutive-drops (now {self.limit}) if such a drop rate is expected"
        )

    def _cause(self) -> str:
        """What dropped the groups, most frequent first; the reward's first error (long) last."""
        causes: dict[str, str] = {}
        for reason, _ in self.reasons.most_common():
            if reason.startswith(("reward_failed", "no_reward")):
                causes.setdefault("reward", f"the reward ({reward_source(self.args)}) failed")
            elif reason.startswith("aborted"):
                causes.setdefault("aborted", "the engines aborted requests (stopped, restarted or out of memory?)")
            else:
                path = getattr(self.args, "dynamic_sampling_filter_path", None)
                who = (
                    f"the dynamic sampling filter --dynamic-sampling-filter-path {path}" if path else "the data buffer"
                )
                causes.setdefault("filter", f"{who} rejected groups")
        if "reward" in causes and self.first_error:
            causes["reward"] = causes.pop("reward") + f"; first error: {self.first_error}"
        text = "; ".join(causes.values())
        return text[0].upper() + text[1:]
