"""The fully async data buffer between generation and training.

Three operations only: `put` a finished group, `take` a training batch, report `metrics`.
A group is dropped on arrival when generation gave it up (aborted) or the filter rejects it,
and on the way out when its staleness — current weight version minus the oldest version of
any token in the group — exceeds the limit. Capacity is bounded: `put` blocks when full.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from miles.rollout.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)

Group = list[Sample]


def group_min_version(group: Group) -> int | None:
    versions = [v for s in group if (v := s.oldest_weight_version) is not None]
    return min(versions) if versions else None


def group_staleness(group: Group, current_version: int, *, steps_per_version: int = 1) -> int | None:
    """Policy updates between the oldest token of the group and now (None: no versioned token)."""
    v = group_min_version(group)
    return None if v is None else (current_version - v) * steps_per_version


@dataclass
class BufferConfig:
    capacity: int
    max_staleness: int | None
    steps_per_version: int = 1


class DataBuffer:
    """Bounded FIFO with arrival and staleness filters; replaceable by `--custom-async-data-buffer-path`."""

    def __init__(self, cfg: BufferConfig, *, unused_handler: Callable[[Group, str], None],
                 filter_fn: Callable[[Group], tuple[bool, str | None]] | None = None):
        if cfg.capacity < 1:
            raise ValueError(f"async data buffer capacity={cfg.capacity}; raise --async-data-buffer-capacity-factor")
        self.cfg = cfg
        self._unused = unused_handler
        self._filter = filter_fn
        self._groups: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self._window = {"aborted_groups_filtered": 0, "stale_groups_filtered": 0, "filter_rejected_groups": 0}
        self._taken_staleness: list[int] = []
        self._queue_size_at_take = 0
        self._last_version = 0

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: Group) -> bool:
        """Accept a finished group (blocking while full); False when it was dropped on arrival."""
        if any(s.status in (SampleStatus.ABORTED, SampleStatus.FAILED) for s in group):
            self._window["aborted_groups_filtered"] += 1
            self._unused(group, "aborted")
            return False
        if self._filter is not None:
            keep, reason = self._filter(group)
            if not keep:
                self._window["filter_rejected_groups"] += 1
                logger.debug("filter rejected group %s: %s", group[0].group_index, reason)
                return False  # no gradient signal: never retried
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._groups) < self.cfg.capacity)
            self._groups.append(group)
            self._cond.notify_all()
        return True

    async def take(self, num_groups: int, *, current_version: int) -> list[Group]:
        """The next `num_groups` fresh-enough groups in arrival order (waits for them)."""
        self._last_version = current_version
        out: list[Group] = []
        self._queue_size_at_take = len(self._groups)
        while len(out) < num_groups:
            async with self._cond:
                await self._cond.wait_for(lambda: len(self._groups) > 0)
                group = self._groups.popleft()
                self._cond.notify_all()
            st = group_staleness(group, current_version, steps_per_version=self.cfg.steps_per_version)
            if self.cfg.max_staleness is not None and st is not None and st > self.cfg.max_staleness:
                self._window["stale_groups_filtered"] += 1
                self._unused(group, "stale")
                continue
            self._taken_staleness.append(st or 0)
            out.append(group)
        return out

    def snapshot_groups(self) -> list[Group]:
        """Groups still waiting (for checkpoints)."""
        return list(self._groups)

    def metrics(self) -> dict[str, float]:
        waiting = [group_staleness(g, self._last_version, steps_per_version=self.cfg.steps_per_version) or 0
                   for g in self._groups]
        taken = self._taken_staleness
        m = {
            "queue_size": float(self._queue_size_at_take),
            "avg_staleness": sum(taken) / len(taken) if taken else 0.0,
            "max_staleness": float(max(taken)) if taken else 0.0,
            "buffer_avg_staleness": sum(waiting) / len(waiting) if waiting else 0.0,
            "buffer_max_staleness": float(max(waiting)) if waiting else 0.0,
            **{k: float(v) for k, v in self._window.items()},
        }
        self._taken_staleness = []
        self._window = dict.fromkeys(self._window, 0)
        return {f"rollout/fully_async/{k}": v for k, v in m.items()}
