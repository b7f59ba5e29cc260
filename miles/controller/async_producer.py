"""The fully async producer: keeps `async_max_concurrent_samples` trajectories generating and puts
finished groups into the run's buffer; the trainer takes its batches through `AsyncProducer.take`.

`GroupLedger` tracks every group started until the trainer takes it or the buffer drops it, so a
checkpoint saves exactly the prompts that are generating or waiting.
"""

from __future__ import annotations

import asyncio
import logging

from miles.config import MilesConfig
from miles.controller.buffer import DataBuffer, Group
from miles.controller.drop_guard import DropGuard, max_consecutive_drops
from miles.controller.group_runner import GroupRunner, sampling_from_config
from miles.controller.rollout_manager import group_drop_reason, prompt_group
from miles.controller.run import MilesRun
from miles.controller.signals import StopRequested
from miles.errors import RunFailed
from miles.rollout.sample import Sample

logger = logging.getLogger(__name__)

_PACE_POLL_S = 0.02
_EMPTY_SOURCE_POLL_S = 0.05
_STALL_WARN_S = 30.0


class GroupLedger:
    """Groups started and not yet resolved (taken by the trainer or dropped by the buffer)."""

    def __init__(self) -> None:
        self._groups: dict[int, Group] = {}

    def add(self, group: Group) -> None:
        self._groups[id(group)] = group

    def resolve(self, group: Group) -> None:
        self._groups.pop(id(group), None)

    def __len__(self) -> int:
        return len(self._groups)

    def pending_prompts(self) -> list[list[dict]]:
        """Fresh copies of every unresolved group's prompts (outputs cleared), oldest first."""
        out = []
        for group in sorted(self._groups.values(), key=lambda g: g[0].group_index or 0):
            copies = [Sample.from_dict(s.to_dict()) for s in prompt_group(group)]
            for c in copies:
                c.reset_for_retry()
            out.append([c.to_dict() for c in copies])
        return out


def staleness_at_take(position: int, batch_groups: int, *, trainer_waiting: bool, steps_per_version: int) -> int:
    """Expected staleness of a group started now, `position` groups behind the unresolved ones.

    A waiting trainer takes positions [0, batch) at the current version; every later batch one
    version later. A training trainer takes its next batch only after its push.
    """
    return (position // batch_groups + (0 if trainer_waiting else 1)) * steps_per_version


class AsyncProducer:
    """Keeps generation running; replacement by sample (default) or by group."""

    def __init__(
        self,
        cfg: MilesConfig,
        run: MilesRun,
        buffer: DataBuffer,
        ledger: GroupLedger,
        *,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self.run = run
        self.buffer = buffer
        self.ledger = ledger
        self.n = cfg.rollout.n_samples_per_prompt
        self.batch_groups = cfg.rollout.rollout_batch_size
        limit = cfg.async_.async_max_concurrent_samples or self.batch_groups * self.n
        self.max_in_flight = max(limit, self.n)
        # started and not yet taken: generating groups plus a full buffer, never more
        self.max_unresolved = -(-self.max_in_flight // self.n) + buffer_capacity(cfg)
        self.by_sample = (cfg.rollout.rollout_submission_granularity or "sample") == "sample"
        self.steps_per_version = max(1, cfg.rollout.num_steps_per_rollout or 1)
        self.max_staleness = cfg.async_.max_weight_staleness
        self.pace = cfg.async_.async_staleness_policy == "pace" and self.max_staleness is not None
        self.runner = GroupRunner(
            cfg,
            run.router,
            run.tokenizer,
            sampling_from_config(cfg.rollout),
            plugin_args=run.plugin_args,
            deterministic_seed=cfg.data.rollout_seed if cfg.engine.deterministic else None,
            teacher=run.teacher,
        )
        # every group dropped on arrival, many in a row: stop with the cause instead of generating forever
        self.guard = DropGuard(
            max_consecutive_drops(cfg.rollout), target=None, args=run.plugin_args, where="fully async generation"
        )
        self.stop_event = stop  # a stop signal ends a trainer's wait for groups at once
        self._slots = asyncio.Semaphore(self.max_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._trainer_waiting = False
        self._failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._paced_s = 0.0
        self._blocked_puts = 0  # finished groups waiting to enter the buffer

    # ---- control -----------------------------------------------------------------------
    def start(self) -> None:
        self._main = asyncio.create_task(self._loop(), name="miles-async-producer")
        self._main.add_done_callback(self._on_done)

    def pause(self) -> None:
        """Start no new group (in-flight ones finish); used by eval on the shared engines."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def stop(self) -> None:
        tasks = [t for t in [self._main, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the trainer side ------------------------------------------------------------------
    async def take(self, num_groups: int, *, current_version: int) -> list[Group]:
        """A batch from the buffer; raises if generation failed (or a stop signal came) instead of waiting forever."""
        self._trainer_waiting = True
        take = asyncio.ensure_future(self.buffer.take(num_groups, current_version=current_version))
        stop = asyncio.ensure_future(self.stop_event.wait()) if self.stop_event is not None else None
        try:
            while not (
                await asyncio.wait(
                    [w for w in (take, self._failure, stop) if w is not None],
                    timeout=_STALL_WARN_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            )[0]:
                logger.warning(
                    "the trainer has waited %.0f s for %d groups: %d started and unresolved, paused=%s, "
                    "pace=%s (is the data source exhausted or the engines stuck?)",
                    _STALL_WARN_S,
                    num_groups,
                    len(self.ledger),
                    not self._running.is_set(),
                    self.pace,
                )
            if self._failure.done():
                failure = self._failure.exception()
                if isinstance(failure, RunFailed):
                    raise failure
                raise RuntimeError("fully async generation failed") from failure
            if not take.done():
                raise StopRequested  # groups taken so far stay in the ledger: the checkpoint keeps their prompts
            groups = take.result()
        finally:
            self._trainer_waiting = False
            for waiter in (take, stop):
                if waiter is not None and not waiter.done():
                    waiter.cancel()
        for g in groups:
            self.ledger.resolve(g)
        return groups

    def metrics(self) -> dict[str, float]:
        m = {
            "rollout/fully_async/unresolved_groups": float(len(self.ledger)),
            "rollout/fully_async/paced_time": self._paced_s,
            **self.runner.pop_metrics(),
        }
        self._paced_s = 0.0
        return m

    # ---- generation -------------------------------------------------------------------------
    def _pace_ok(self) -> bool:
        if not self.pace:
            return True
        expected = staleness_at_take(
            len(self.ledger),
            self.batch_groups,
            trainer_waiting=self._trainer_waiting,
            steps_per_version=self.steps_per_version,
        )
        return expected <= self.max_staleness

    async def _loop(self) -> None:
        while not self._failure.done():
            await self._running.wait()
            for _ in range(self.n):  # a new group needs n free places
                await self._slots.acquire()
            while (
                self._blocked_puts
                or len(self.ledger) >= self.max_unresolved
                or not self._pace_ok()
                or not self._running.is_set()
            ):  # the trainer is behind (full buffer), pacing, or eval
                await asyncio.sleep(_PACE_POLL_S)
                if not self._pace_ok():
                    self._paced_s += _PACE_POLL_S
            groups = self.run.data_source.get_samples(1)
            if not groups:  # a finite source ran dry
                self._release(self.n)
                await asyncio.sleep(_EMPTY_SOURCE_POLL_S)
                continue
            group = groups[0]
            self.ledger.add(group)  # before any await: a checkpoint taken now must see it
            task = asyncio.create_task(self._run_group(group), name=f"miles-async-group-{group[0].group_index}")
            self._tasks.add(task)
            task.add_done_callback(self._on_done)

    def _release(self, k: int) -> None:
        for _ in range(k):
            self._slots.release()

    def _on_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None or self._failure.done():
            return
        if not isinstance(task.exception(), RunFailed):  # a RunFailed is reported once, by the trainer's wait
            logger.error("fully async generation failed: %r", task.exception())
        self._failure.set_exception(task.exception())

    async def _run_group(self, group: Group) -> None:
        released = 0

        async def one(sample: Sample) -> list[Sample]:
            nonlocal released
            try:
                return await self.runner.trajectory(sample)
            finally:
                if self.by_sample:  # this trajectory's place is free at once
                    released += 1
                    self._slots.release()

        try:
            # the same list object (the ledger knows it); a generate function may return several trajectories
            group[:] = [s for trajectory in await asyncio.gather(*(one(s) for s in group)) for s in trajectory]
            if self.runner.scores_whole_groups:
                await self.runner.score(group, whole_group=True)
        finally:
            self._release(self.n - released)
        reason = group_drop_reason(group) or "filtered"  # why the buffer would drop it (read before a retry resets it)
        self._blocked_puts += 1
        try:
            accepted = await self.buffer.put(group)
        finally:
            self._blocked_puts -= 1
        if accepted:
            self.guard.accept()
        else:
            self.ledger.resolve(group)
            self.guard.drop(group, reason)


def buffer_capacity(cfg: MilesConfig) -> int:
    """Groups the buffer holds: --async-data-buffer-capacity-factor x rollout_batch_size."""
    return int(cfg.async_.async_data_buffer_capacity_factor * cfg.rollout.rollout_batch_size)
