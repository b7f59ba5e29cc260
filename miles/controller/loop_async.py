"""Fully asynchronous RL: generation never stops; the trainer takes whatever groups are ready.

A background producer keeps `async_max_concurrent_samples` trajectories generating. Finished
groups go into a bounded buffer; each step takes `rollout_batch_size` groups from it, trains,
and pushes new weights while generation goes on (engines pause only to install them, in
`retract` mode by default, so partial trajectories resume on the new weights).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from miles.controller.buffer import BufferConfig, DataBuffer, Group
from miles.controller.eval import Evaluator
from miles.controller.rollout_manager import GroupRunner, sampling_from_config
from miles.controller.run import MilesRun
from miles.controller.signals import StopRequest
from miles.rollout.filters import apply_filter
from miles.utils.misc import load_function
from miles.utils.progress import StepProgress

logger = logging.getLogger(__name__)


class AsyncProducer:
    """Keeps generation running; replacement by sample (default) or by group."""

    def __init__(self, cfg, run: MilesRun, buffer: DataBuffer):
        self.cfg = cfg
        self.run = run
        self.buffer = buffer
        n = cfg.rollout.n_samples_per_prompt
        self.n = n
        limit = cfg.async_.async_max_concurrent_samples or cfg.rollout.rollout_batch_size * n
        self.max_in_flight = max(limit, n)
        self.by_sample = (cfg.rollout.rollout_submission_granularity or "sample") == "sample"
        self.runner = GroupRunner(run.args, run.router, run.tokenizer, sampling_from_config(cfg.rollout))
        self._slots = asyncio.Semaphore(self.max_in_flight)
        self._in_flight: dict[int, Group] = {}
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None
        self._paused = asyncio.Event()
        self._paused.set()  # set = running
        self.pace = cfg.async_.async_staleness_policy == "pace"

    def start(self) -> None:
        self._main = asyncio.create_task(self._loop(), name="miles-async-producer")

    def pause(self) -> None:
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    async def stop(self) -> None:
        if self._main is not None:
            self._main.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*([self._main] if self._main else []), *self._tasks, return_exceptions=True)

    def in_flight_groups(self) -> list[Group]:
        return list(self._in_flight.values())

    def _pace_ok(self) -> bool:
        """With the pace policy, start a group only if it should be consumed within the staleness limit."""
        limit = self.cfg.async_.max_weight_staleness
        if not self.pace or limit is None:
            return True
        ahead = len(self.buffer) + len(self._in_flight)
        steps_until_taken = ahead // self.cfg.rollout.rollout_batch_size
        return steps_until_taken * max(1, self.cfg.rollout.num_steps_per_rollout or 1) <= limit

    async def _loop(self) -> None:
        while True:
            await self._paused.wait()
            while not self._pace_ok():
                await asyncio.sleep(0.01)
            for _ in range(self.n):  # a new group needs n free places
                await self._slots.acquire()
            groups = self.run.data_source.get_samples(1)
            if not groups:
                for _ in range(self.n):
                    self._slots.release()
                await asyncio.sleep(0.05)
                continue
            group = groups[0]
            task = asyncio.create_task(self._run_group(group))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("async group failed: %r", task.exception())

    async def _run_group(self, group: Group) -> None:
        key = id(group)
        self._in_flight[key] = group
        released = 0

        async def one(sample):
            nonlocal released
            try:
                return await self.runner._one(sample)
            finally:
                if self.by_sample:
                    released += 1
                    self._slots.release()

        try:
            done = list(await asyncio.gather(*(one(s) for s in group)))
            if self.runner.args.group_rm or self.runner.group_reward_fn is not None:
                await self.runner.score(done, whole_group=True)
        finally:
            if not self.by_sample:
                for _ in range(self.n):
                    self._slots.release()
            elif released < self.n:
                for _ in range(self.n - released):
                    self._slots.release()
            self._in_flight.pop(key, None)
        await self.buffer.put(done)


def _unused_handler(run: MilesRun, policy: str):
    def handle(group: Group, reason: str) -> None:
        if policy == "retry":
            for s in group:
                s.reset_for_retry()
            run.data_source.add_samples([group])

    return handle


def make_buffer(cfg, run: MilesRun) -> DataBuffer:
    a = cfg.async_
    steps = cfg.rollout.num_steps_per_rollout or 1
    if steps > 1:
        logger.warning("num_steps_per_rollout=%d in fully async mode: every weight version is %d policy updates, "
                       "so staleness is counted in policy updates (version gap x %d)", steps, steps, steps)
    bcfg = BufferConfig(capacity=int(a.async_data_buffer_capacity_factor * cfg.rollout.rollout_batch_size),
                        max_staleness=a.max_weight_staleness, steps_per_version=steps)
    flt = load_function(cfg.rollout.dynamic_sampling_filter_path)

    def filter_fn(group):
        out = apply_filter(flt, run.args, group)
        return out.keep, out.reason

    cls = load_function(a.custom_async_data_buffer_path) or DataBuffer
    return cls(bcfg, unused_handler=_unused_handler(run, a.async_unused_samples_handler),
               filter_fn=filter_fn if flt is not None else None)


def _pending_prompts(producer: AsyncProducer, buffer: DataBuffer) -> list[list[dict]]:
    groups = buffer.snapshot_groups() + producer.in_flight_groups()
    out = []
    for g in groups:
        copies = []
        for s in g:
            c = type(s).from_dict(s.to_dict())
            c.reset_for_retry()
            copies.append(c.to_dict())
        out.append(copies)
    return out


async def train(cfg) -> str:
    stop = StopRequest().install()
    run = await MilesRun.start(cfg)
    async with run:
        buffer = make_buffer(cfg, run)
        producer = AsyncProducer(cfg, run, buffer)
        run.pending_state_fn = lambda: _pending_prompts(producer, buffer)
        evaluator = Evaluator(cfg, run)
        trained_log = open(os.path.join(cfg.runtime.output_dir, "trained_prompts.jsonl"), "a", buffering=1)
        await run.push_weights(version=run.weight_version)
        producer.start()
        try:
            with StepProgress(cfg, start=run.start_rollout_id) as progress:
                for rollout_id in range(run.start_rollout_id, cfg.rollout.num_rollout):
                    step_start = run.begin_step()
                    groups = await run._wait("train_wait_time",
                                             buffer.take(cfg.rollout.rollout_batch_size,
                                                         current_version=run.weight_version))
                    rollout_metrics = {**buffer.metrics(), **_group_metrics(groups)}
                    trained_log.write(json.dumps({"step": rollout_id, "group_index": [g[0].group_index for g in groups]}) + "\n")
                    train_metrics = await run.train(rollout_id, run.to_train_batch(groups))
                    await run.maybe_save(rollout_id)
                    await run.push_weights(version=run.weight_version + 1)
                    eval_metrics = await evaluator.maybe_eval(rollout_id + 1, pause=producer)
                    progress.update(run.log_step(rollout_id, step_start, rollout_metrics, train_metrics, eval_metrics))
                    if stop.requested:
                        await run.maybe_save(rollout_id, force=True)
                        break
        finally:
            await producer.stop()
            trained_log.close()
    stop.uninstall()
    return cfg.runtime.output_dir


def _group_metrics(groups: list[Group]) -> dict[str, float]:
    from miles.controller.rollout_manager import SyncRolloutManager

    return SyncRolloutManager._metrics(groups, {}, len(groups))


def run(cfg) -> int:
    from miles.utils.progress import print_reward_curve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out_dir = asyncio.run(train(cfg))
    print_reward_curve(out_dir)
    return 0
