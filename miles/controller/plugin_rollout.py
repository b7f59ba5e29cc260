"""The sync rollout step when `--rollout-function-path` replaces it: the plug-in's groups, checked.

The rollout function brings its own tasks, grouping and rewards; this wrapper only makes its
output trainable and says which plug-in broke a contract when it does not: every sample rewarded,
finished (completed or truncated), with per-token lists as long as its response. Group and sample
ids the plug-in left unset are assigned here (a group's samples share `group_index`, which the
reward normalisation groups by). Nested lists inside a group (several trajectories of one
episode) are flattened.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from miles.agent.plugins import load_rollout
from miles.config import RolloutConfig
from miles.controller.rollout_manager import RolloutResult, rollout_metrics
from miles.errors import RolloutStalled
from miles.rollout.data_source import DataSource
from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value

logger = logging.getLogger(__name__)


class PluginRolloutManager:
    """`generate(rollout_id)` over a rollout plug-in (same interface as SyncRolloutManager)."""

    def __init__(
        self,
        args: argparse.Namespace,
        rollout_cfg: RolloutConfig,
        data_source: DataSource,
        weight_version: Callable[[], int],
    ) -> None:
        self.args = args
        self.path = rollout_cfg.rollout_function_path
        self.fn = load_rollout(self.path, args, data_source)
        self.weight_version = weight_version
        self._group_ids = itertools.count(1_000_000_000)  # clear of the data source's ids
        self._sample_ids = itertools.count(1_000_000_000)

    async def generate(self, rollout_id: int) -> RolloutResult:
        out = await self.fn(rollout_id, self.weight_version())
        groups = [self._checked_group(g, rollout_id) for g in out.samples]
        if not groups:
            raise RolloutStalled(f"--rollout-function-path {self.path!r} returned no groups at rollout {rollout_id}")
        metrics = rollout_metrics(groups, Counter(), len(groups), self.args.reward_key)
        metrics.update(out.metrics or {})
        return RolloutResult(groups, metrics)

    def _checked_group(self, group: Any, rollout_id: int) -> list[Sample]:
        samples = _flatten(group)
        if not samples:
            raise ValueError(f"--rollout-function-path {self.path!r}: an empty group at rollout {rollout_id}")
        group_index = next((s.group_index for s in samples if s.group_index is not None), None)
        group_index = next(self._group_ids) if group_index is None else group_index
        for s in samples:
            s.group_index = group_index if s.group_index is None else s.group_index
            s.index = next(self._sample_ids) if s.index is None else s.index
            self._check(s, rollout_id)
        return samples

    def _check(self, sample: Sample, rollout_id: int) -> None:
        where = f"--rollout-function-path {self.path!r} (rollout {rollout_id}, sample {sample.index})"
        if sample.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            raise ValueError(
                f"{where}: status {sample.status.value}; return finished samples only "
                "(completed or truncated), drop or retry the others inside the rollout function"
            )
        try:
            sample.validate()
            value = reward_value(sample, self.args.reward_key)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if not math.isfinite(value):
            raise ValueError(f"{where}: reward {value} is not a finite number")


def _flatten(group: Any) -> list[Sample]:
    if isinstance(group, Sample):
        return [group]
    if not isinstance(group, (list, tuple)):
        raise TypeError(f"a rollout function's group must be a list of Samples, got {type(group).__name__}")
    return [s for item in group for s in _flatten(item)]
