"""The fully async data buffer between generation and training.

Three operations only: `put` a finished group, `take` a training batch, report `metrics`.
A group is dropped on arrival when generation gave it up (aborted, or its reward failed) or the
filter rejects it, and on the way out when its staleness — current weight version minus the
oldest version of any token in the group — exceeds the limit. Capacity is bounded: `put` blocks
while the buffer is full.

Every dropped group goes to `unused_handler(group, reason)` with reason `aborted`, `filtered`
or `stale`; the handler decides whether the prompt is retried (never for `filtered`: such a
group carries no gradient signal).

A replacement (`--custom-async-data-buffer-path pkg.mod:Cls`) is constructed as
`Cls(BufferConfig, unused_handler=..., filter_fn=...)` and provides the same three coroutines /
methods; `put` returns False when it dropped the group.
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
UnusedHandler = Callable[[Group, str], None]
GroupFilter = Callable[[Group], tuple[bool, str | None]]

METRIC_PREFIX = "rollout/fully_async/"


def group_min_version(group: Group) -> int | None:
    """The oldest weight version of any token in the group (None: no versioned token)."""
    versions = [v for s in group if (v := s.oldest_weight_version) is not None]
    return min(versions) if versions else None


def group_staleness(group: Group, current_version: int, *, steps_per_version: int = 1) -> int | None:
    """Policy updates between the oldest token of the group and now (None: no versioned token)."""
    v = group_min_version(group)
    return None if v is None else (current_version - v) * steps_per_version


def gave_up(group: Group) -> bool:
    """Generation gave the group up: a sample was aborted or its reward failed after retries."""
    return any(s.status in (SampleStatus.ABORTED, SampleStatus.FAILED) for s in group)


@dataclass(slots=True)
class BufferConfig:
    capacity: int  # groups
    max_staleness: int | None  # policy updates; None = no limit
    steps_per_version: int = 1  # optimizer steps per weight version (num_steps_per_rollout)


class DataBuffer:
    """Bounded FIFO with arrival and staleness filters; replaceable by `--custom-async-data-buffer-path`."""

    def __init__(self, cfg: BufferConfig, *, unused_handler: UnusedHandler, filter_fn: GroupFilter | None = None):
        if cfg.capacity < 1:
            raise ValueError(
                f"async data buffer capacity={cfg.capacity} groups; raise "
                "--async-data-buffer-capacity-factor (capacity = factor x rollout_batch_size)"
            )
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
        if gave_up(group):
            self._window["aborted_groups_filtered"] += 1
            self._unused(group, "aborted")
            return False
        if self._filter is not None:
            keep, reason = self._filter(group)
            if not keep:
                self._window["filter_rejected_groups"] += 1
                logger.debug("filter rejected group %s: %s", group[0].group_index, reason)
                self._unused(group, "filtered")
                return False
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._groups) < self.cfg.capacity)
            self._groups.append(group)
            self._cond.notify_all()
        return True

    async def take(self, num_groups: int, *, current_version: int) -> list[Group]:
        """The next `num_groups` fresh-enough groups in arrival order (waits for them)."""
        self._last_version = current_version
        self._queue_size_at_take = len(self._groups)
        out: list[Group] = []
        while len(out) < num_groups:
            async with self._cond:
                await self._cond.wait_for(lambda: len(self._groups) > 0)
                group = self._groups.popleft()
                self._cond.notify_all()
            staleness = group_staleness(group, current_version, steps_per_version=self.cfg.steps_per_version)
            limit = self.cfg.max_staleness
            if limit is not None and staleness is not None and staleness > limit:
                self._window["stale_groups_filtered"] += 1
                self._unused(group, "stale")
                continue
            self._taken_staleness.append(staleness or 0)
            out.append(group)
        return out

    def metrics(self) -> dict[str, float]:
        """The step's buffer figures (Table 2 of the design); resets the per-step counters."""
        waiting = [
            group_staleness(g, self._last_version, steps_per_version=self.cfg.steps_per_version) or 0
            for g in self._groups
        ]
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
        return {METRIC_PREFIX + k: v for k, v in m.items()}
