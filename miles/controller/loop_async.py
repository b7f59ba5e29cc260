"""Fully asynchronous RL: generation never stops; the trainer takes whatever groups are ready.

A background producer keeps `async_max_concurrent_samples` trajectories generating. Finished
groups go into a bounded buffer; each step takes `rollout_batch_size` groups from it, trains,
and pushes new weights while generation goes on (engines pause only to install them, in
`retract` mode by default, so partial trajectories resume on the new weights and their tokens
keep the versions that produced them).

Every group the producer started is tracked until the trainer takes it or the buffer drops it,
so a checkpoint saves exactly the prompts that are generating or waiting: a resumed run neither
loses nor repeats a prompt.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TextIO

from miles.config import MilesConfig
from miles.controller.async_eval import AsyncEval
from miles.controller.async_producer import AsyncProducer, GroupLedger, buffer_capacity
from miles.controller.buffer import BufferConfig, DataBuffer, Group, UnusedHandler
from miles.controller.rollout_manager import prompt_group, retry_after_reward_failure, rollout_metrics
from miles.controller.run import MilesRun, run_driver
from miles.controller.setup import start_run
from miles.controller.signals import StopRequest, StopRequested
from miles.rollout.filters import apply_filter
from miles.rollout.sample import SampleStatus
from miles.utils.misc import load_function
from miles.utils.progress import StepProgress

logger = logging.getLogger(__name__)


def _unused_handler(run: MilesRun, ledger: GroupLedger, policy: str) -> UnusedHandler:
    def handle(group: Group, reason: str) -> None:
        ledger.resolve(group)
        if policy != "retry" or reason == "filtered":  # a filter-rejected group has no signal: discarded
            return
        if any(s.status == SampleStatus.FAILED for s in group) and not retry_after_reward_failure(group):
            return
        group = prompt_group(group)
        for s in group:
            s.reset_for_retry()
        run.data_source.add_samples([group])

    return handle


def make_buffer(cfg: MilesConfig, run: MilesRun, ledger: GroupLedger) -> DataBuffer:
    a = cfg.async_
    steps = cfg.rollout.num_steps_per_rollout or 1
    if steps > 1:
        logger.warning(
            "num_steps_per_rollout=%d in fully async mode: each weight version is %d policy updates, "
            "so staleness counts policy updates (version gap x %d) against --max-weight-staleness",
            steps,
            steps,
            steps,
        )
    bcfg = BufferConfig(capacity=buffer_capacity(cfg), max_staleness=a.max_weight_staleness, steps_per_version=steps)
    flt = load_function(cfg.rollout.dynamic_sampling_filter_path)

    def filter_fn(group: Group) -> tuple[bool, str | None]:
        out = apply_filter(flt, run.plugin_args, group)
        return out.keep, out.reason

    cls = load_function(a.custom_async_data_buffer_path) or DataBuffer
    return cls(
        bcfg,
        unused_handler=_unused_handler(run, ledger, a.async_unused_samples_handler),
        filter_fn=filter_fn if flt is not None else None,
    )


async def train(cfg: MilesConfig) -> str:
    stop = StopRequest(saves=bool(cfg.train.save)).install()
    try:
        async with await start_run(cfg) as run:
            await _produce_and_train(cfg, run, stop)
    finally:
        stop.uninstall()
    return cfg.runtime.output_dir


async def _produce_and_train(cfg: MilesConfig, run: MilesRun, stop: StopRequest) -> None:
    ledger = GroupLedger()
    buffer = make_buffer(cfg, run, ledger)
    producer = AsyncProducer(cfg, run, buffer, ledger, stop=stop.event)
    run.pending_state_fn = ledger.pending_prompts
    evals = AsyncEval(cfg, run, producer)
    trained_log = open(os.path.join(cfg.runtime.output_dir, "trained_prompts.jsonl"), "a", buffering=1)
    await run.push_weights(version=run.weight_version)
    run.startup_mark("first_push")
    await evals.before_train(run.start_rollout_id)
    producer.start()
    try:
        await _steps(cfg, run, stop, producer, buffer, evals, trained_log)
    finally:
        await producer.stop()
        # drops and rejections after the last step's metrics: no step reports them, so they go here
        tail = {k: v for k, v in buffer.metrics().items() if k.endswith("_filtered") or k.endswith("_groups")}
        with open(os.path.join(cfg.runtime.output_dir, "async_tail_metrics.json"), "w") as f:
            json.dump(tail, f)
        await evals.close()
        trained_log.close()


async def _steps(
    cfg: MilesConfig,
    run: MilesRun,
    stop: StopRequest,
    producer: AsyncProducer,
    buffer: DataBuffer,
    evals: AsyncEval,
    trained_log: TextIO,
) -> None:
    with StepProgress(
        cfg.rollout.num_rollout, start=run.start_rollout_id, enabled=cfg.logging.progress_bar
    ) as progress:
        for rollout_id in range(run.start_rollout_id, cfg.rollout.num_rollout):
            await run.profile_hooks(rollout_id, "start")
            step_start = run.begin_step()
            try:
                groups = await run.timed(
                    "train_wait_time",
                    producer.take(cfg.rollout.rollout_batch_size, current_version=run.weight_version),
                )
            except StopRequested:  # stopped while waiting for groups: the last finished step is the boundary
                if rollout_id > 0:
                    await run.maybe_save(rollout_id - 1, force=True)
                break
            rollout_metrics = {**buffer.metrics(), **producer.metrics(), **_group_metrics(groups)}
            trained_log.write(
                json.dumps({"step": rollout_id, "group_index": [g[0].group_index for g in groups]}) + "\n"
            )
            train_metrics = await run.train(rollout_id, run.to_train_batch(groups))
            await run.maybe_save(rollout_id)
            await run.push_weights(version=run.weight_version + 1)
            eval_metrics = await evals.after_push(rollout_id + 1, last=rollout_id + 1 == cfg.rollout.num_rollout)
            progress.update(run.log_step(rollout_id, step_start, rollout_metrics, train_metrics, eval_metrics))
            await run.profile_hooks(rollout_id, "end")
            if stop.requested:
                await run.maybe_save(rollout_id, force=True)
                break


def _group_metrics(groups: list[Group]) -> dict[str, float]:
    return rollout_metrics(groups, {}, len(groups))


def run(cfg: MilesConfig) -> int:
    """`miles train --fully-async` entry."""
    return run_driver(train, cfg)
