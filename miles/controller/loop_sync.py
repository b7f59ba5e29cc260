"""The synchronous RL loop: generate → train → save → offload → push weights → eval.

The debug modes run the same loop with one side missing: `--debug-rollout-only` starts no trainer
(train and weight pushes do nothing), `--debug-train-only` starts no engine (rollouts are read back).
SFT (`--loss-type sft_loss`) starts no engine either: each step trains on the next rows of its data.
Weights go to the engines every `--update-weights-interval` steps, and always before an eval and
after the last step, so an eval never scores stale weights.
"""

from __future__ import annotations

import logging

from miles.config import MilesConfig, is_sft
from miles.controller.debug_rollout import debug_rollouts
from miles.controller.eval import Evaluator
from miles.controller.plugin_rollout import PluginRolloutManager
from miles.controller.rollout_manager import SyncRolloutManager
from miles.controller.run import MilesRun, run_driver
from miles.controller.setup import start_run
from miles.controller.sft import SupervisedRollouts
from miles.controller.signals import StopRequest, StopRequested
from miles.utils.progress import StepProgress

logger = logging.getLogger(__name__)


async def train(cfg: MilesConfig) -> str:
    stop = StopRequest(saves=bool(cfg.train.save)).install()
    try:
        async with await start_run(cfg) as run:
            await _steps(cfg, run, stop)
    finally:
        stop.uninstall()
    return cfg.runtime.output_dir


async def _steps(cfg: MilesConfig, run: MilesRun, stop: StopRequest) -> None:
    if is_sft(cfg):  # the next rows of the supervised data, no engine
        rollout = SupervisedRollouts(run.data_source, cfg.rollout.rollout_batch_size)
    else:  # --load-debug-rollout-data replays saved rollouts; --save-debug-rollout-data writes each step's
        rollout = debug_rollouts(cfg.runtime, run.start_rollout_id, lambda: rollout_manager(cfg, run, stop))
    evaluator = Evaluator(cfg, run)
    await run.push_weights(version=run.weight_version)  # engines start from the trainer's weights
    run.startup_mark("first_push")  # the engines' first weights
    await evaluator.maybe_eval(run.start_rollout_id, before_train=True)
    with StepProgress(
        cfg.rollout.num_rollout, start=run.start_rollout_id, enabled=cfg.logging.progress_bar
    ) as progress:
        for rollout_id in range(run.start_rollout_id, cfg.rollout.num_rollout):
            await run.profile_hooks(rollout_id, "start")
            step_start = run.begin_step()
            try:
                async with run.generation_phase():  # colocated: the engines hold the GPUs meanwhile
                    result = await run.timed("rollout/generate_time", rollout.generate(rollout_id))
            except StopRequested:  # stopped while generating: the last finished step is the boundary
                if rollout_id > 0:
                    await run.maybe_save(rollout_id - 1, force=True)
                break
            train_metrics = await run.train(rollout_id, run.to_train_batch(result.groups))
            await run.maybe_save(rollout_id)
            if weights_due(cfg, evaluator, rollout_id + 1):
                await run.push_weights(version=rollout_id + 1)
            eval_metrics = await evaluator.maybe_eval(rollout_id + 1)
            progress.update(run.log_step(rollout_id, step_start, result.metrics, train_metrics, eval_metrics))
            await run.profile_hooks(rollout_id, "end")
            if stop.requested:
                await run.maybe_save(rollout_id, force=True)
                break


def rollout_manager(cfg: MilesConfig, run: MilesRun, stop: StopRequest) -> SyncRolloutManager | PluginRolloutManager:
    """The built-in rollout, or the one `--rollout-function-path` names (its own tasks, groups and rewards)."""
    if cfg.rollout.rollout_function_path:
        return PluginRolloutManager(run.plugin_args, cfg.rollout, run.data_source, lambda: run.weight_version)
    return SyncRolloutManager(
        cfg,
        run.router,
        run.data_source,
        run.tokenizer,
        plugin_args=run.plugin_args,
        seed=cfg.data.rollout_seed if cfg.engine.deterministic else None,
        stop=stop.event,
        teacher=run.teacher,
    )


def weights_due(cfg: MilesConfig, evaluator: Evaluator, step: int) -> bool:
    """Push after `step` rollouts: every --update-weights-interval steps, before an eval, and at the end."""
    return step % cfg.weights.update_weights_interval == 0 or step == cfg.rollout.num_rollout or evaluator.due(step)


def run(cfg: MilesConfig) -> int:
    """`miles train` entry for synchronous runs."""
    return run_driver(train, cfg)
