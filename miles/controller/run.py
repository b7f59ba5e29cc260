"""MilesRun: everything the loop drivers need behind a handful of awaitable calls.

The drivers (`loop_sync`, `loop_async`) read like the paper's pseudocode; this module owns what
they call: weight pushes, training, the colocated hand-over of the GPUs (`generation_phase`),
checkpoints, profiling windows and the step's metrics, each timed by `timed`. `setup.start_run`
builds one. A run without trainer or without engines holds an empty `TrainerGroup` or
`EngineFleet`, whose calls do nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from miles.config import MilesConfig, is_sft
from miles.controller.offload import OffloadPlan
from miles.controller.placement import Placement
from miles.controller.preflight import RunData
from miles.controller.router import EngineFleet, Router
from miles.controller.runtime import Runtime
from miles.controller.signals import StopRequested
from miles.controller.trainers import TrainerGroup
from miles.engines.client import EngineClient
from miles.errors import as_run_failure
from miles.rollout.opd_teacher import TeacherScorer
from miles.rollout.sample import Sample
from miles.rollout.train_data import TrainBatch, samples_to_train_batch, split_by_dp
from miles.utils.gc_freeze import freeze_heap
from miles.utils.metrics import MetricsSink
from miles.utils.profiling import ProfileSchedule
from miles.utils.sysmon import SystemMonitor
from miles.utils.timer import StartupClock, StepTimers
from miles.wire.rpc import RemoteError
from miles.wire.specs import WorkerDied

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
PROFILED_ROLES = ("trainer", "rollout", "eval_rollout")  # worker roles that take start_profile / stop_profile
T = TypeVar("T")


class MilesRun:
    """The run's state (weight versions, resume point, timers) and the verbs the loops call."""

    def __init__(
        self,
        cfg: MilesConfig,
        runtime: Runtime,
        placement: Placement,
        router: Router | None,
        engines: list[EngineClient],
        tokenizer: PreTrainedTokenizerBase,
        sink: MetricsSink,
        data: RunData,
    ):
        self.cfg = cfg
        self.plugin_args = cfg.flat()  # the flat namespace Miles' plug-ins receive (and find the gateway in)
        self.runtime = runtime
        self.trainers = TrainerGroup(runtime, empty=not placement.trainer_specs)
        self.placement = placement
        self.router = router
        self.fleet = EngineFleet(engines)  # the rollout engines, the ones weight updates reach
        self.tokenizer = tokenizer
        self.sink = sink
        self.timers = StepTimers()
        self.data_source = data.prompts
        self.eval_sets = data.eval_sets  # name -> source, read and checked at start-up
        self.weight_version = 0
        # the version of the trainer's weights: weight_version until a step trains, then the version its push
        # gives them (one above the newest pushed or trained); what a checkpoint records and a resume restores
        self.trained_version = 0
        self._saved_steps: set[int] = set()  # steps this run saved: a repeated save of one is skipped
        self.start_rollout_id = 0
        self.engine_versions: list[int] = [0] * len(engines)
        self._last_push_metrics: dict[str, float] | None = None  # the newest weight push, logged with its step
        self._worker_wait_s = 0.0
        self._step_end: float | None = None  # where the last logged step's clock stopped
        # fully async runs save the prompts of buffered and in-flight groups with each checkpoint
        self.pending_state_fn = None
        self.eval_fleet = EngineFleet([])  # dedicated eval engines (--eval-mode dedicated), never updated by pushes
        self.teacher: TeacherScorer | None = None  # --use-opd: who scores the samples
        self.profile = ProfileSchedule(cfg.runtime.profile_steps, cfg.runtime.output_dir)
        self._profiling = False
        self.sysmon = SystemMonitor.for_local_workers(runtime, PROFILED_ROLES)
        # the debug modes start one side only: --debug-rollout-only no trainer, --debug-train-only no engine
        self.offload = OffloadPlan.of(
            cfg, colocated=placement.colocated, has_trainer=bool(self.trainers), has_engines=bool(self.fleet)
        )
        self._engines_released = False  # released for training; given back at the next push or generation
        self._cache_release_logged = False
        self.weights_connected = False  # the trainers' weight updaters reach the engines (set by setup)
        self.startup: StartupClock | None = None
        self._startup_metrics: dict[str, float] = {}
        self.gateway = None  # the session server / router front for plug-ins, when the run needs one

    # ---- stop ------------------------------------------------------------------------
    async def close(self) -> None:
        if self._profiling:  # stopped inside a profile window: still write the traces
            await self._stop_profile()
        # a dead worker is reported once, by the run's own error; the debug modes never connected weights
        if self.runtime.failure is None and self.weights_connected:
            try:
                await self.trainers.close_weights()
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                logger.warning("closing weight sync failed: %s", e)
        if self.gateway is not None:
            await self.gateway.stop()
        await self.fleet.close()
        await self.eval_fleet.close()
        for teacher in self.teacher.teachers.values() if self.teacher is not None else ():
            await teacher.close()
        self.sink.close()
        await self.runtime.shutdown()

    async def __aenter__(self) -> MilesRun:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        lost = None
        try:
            if exc_type is None:  # a background checkpoint write finishes (or fails loudly) before the run ends
                await self.finish_saves()
            lost = await self._lost_peer_behind(exc)
        finally:
            await self.close()
        if lost is not None:
            raise lost from exc

    async def _lost_peer_behind(self, exc: BaseException | None) -> WorkerDied | None:
        """On several nodes a worker's error is often the echo of a peer lost on another node (a gloo or
        NCCL collective whose other end vanished: "Connection reset by peer"). Wait up to the heartbeat
        time-out for the runtime's verdict on every peer and return that death, the cause to report."""
        if not isinstance(exc, RemoteError) or self.runtime.num_nodes < 2 or as_run_failure(exc) is not None:
            return None
        wait_s = self.cfg.runtime.heartbeat_timeout_s + 2 * self.cfg.runtime.heartbeat_interval_s
        try:
            failure = await asyncio.wait_for(self.runtime.wait_failure(), wait_s)
        except TimeoutError:
            return None  # every peer still answers: the worker's own error is the cause
        return failure if isinstance(failure, WorkerDied) else None

    # ---- waiting on workers ------------------------------------------------------------
    async def timed(self, name: str, aw: Awaitable[T]) -> T:
        """Await worker work, timing it as phase `name` (a step metric) and as time spent waiting on workers."""
        start = time.perf_counter()
        try:
            return await aw
        finally:
            dt = time.perf_counter() - start
            self.timers.add(name, dt)
            self._worker_wait_s += dt

    # ---- the loop's verbs ------------------------------------------------------------
    async def push_weights(self, version: int) -> None:
        """Pause engines, move the trainer's weights with the configured transport, continue.

        Without trainer (--debug-rollout-only) the engines keep their initial weights; without engines
        (--debug-train-only) the trainer's weights move on with nowhere to go."""
        await self._resume_engines()
        if not self.trainers:
            return
        if not self.fleet:
            self.weight_version = version
            return
        mode = self.cfg.weights.pause_generation_mode
        await self.timed("update_weights_time", self._push(version, mode))

    async def _push(self, version: int, mode: str) -> None:
        await self.fleet.pause_generation(mode)
        try:
            metrics = await self.trainers.push_weights(version, timeout_s=self.cfg.weights.weight_sync_timeout_s)
            self.weight_version = version
            self.engine_versions = await self.fleet.weight_versions()
            if any(v != version for v in self.engine_versions):
                # disk-delta: hosts that refused a version keep serving the old one; the next push re-bases them
                if not metrics.get("weight_sync/refused_engines"):
                    raise RuntimeError(
                        f"after pushing weight version {version} the engines report {self.engine_versions}"
                    )
                logger.warning(
                    "weight version %d was refused; engines keep serving versions %s until the next push",
                    version,
                    self.engine_versions,
                )
            self._last_push_metrics = metrics
        finally:
            await self.fleet.continue_generation()

    @contextlib.asynccontextmanager
    async def generation_phase(self) -> AsyncIterator[None]:
        """The engines hold the GPUs while the body generates (the colocated hand-over, per `self.offload`).

        Before: the trainer is offloaded, then the engines get back memory released for training (in that
        order: the trainer's state and the engines' memory need not fit on the GPU together). After, and
        when a stop signal ends the body: the engines release their memory and the trainer is onloaded.
        Any other error leaves the workers as they are (the run is ending)."""
        if self.offload.trainer:
            await self.timed("offload_time", self.trainers.offload())
        await self._resume_engines()
        try:
            yield
        except StopRequested:  # the trainer still takes the GPUs back to save the last finished step
            await self._to_trainer()
            raise
        await self._to_trainer()

    async def _to_trainer(self) -> None:
        if self.offload.engine_tags:
            await self.timed("offload_time", self.fleet.release_memory_occupation(list(self.offload.engine_tags)))
            self._engines_released = True
        if self.offload.trainer:
            await self.timed("offload_time", self.trainers.onload())

    async def _resume_engines(self) -> None:
        if self._engines_released:
            if self.trainers:  # what training left in the allocator's cache must not stand in the engines' way
                freed = await self.timed("offload_time", self.trainers.release_cached_memory())
                if not self._cache_release_logged and freed and freed[0]:
                    self._cache_release_logged = True
                    logger.info(
                        "before the engines resume, trainer rank 0 gave back %.1f GiB of cached memory (%.1f GiB "
                        "still reserved)",
                        freed[0]["released_gb"],
                        freed[0]["reserved_gb"],
                    )
            await self.timed("offload_time", self.fleet.resume_memory_occupation(list(self.offload.engine_tags)))
            self._engines_released = False

    def to_train_batch(self, groups: list[list[Sample]]) -> list[TrainBatch]:
        """One shard per trainer rank (none under --debug-rollout-only): one per data-parallel replica,
        the same to every rank of a replica (its tensor- and pipeline-parallel peers)."""
        if not self.trainers:
            return []
        with self.timers("rollout/convert_time"):
            samples = [s for g in groups for s in g]
            algo = self.cfg.algo
            batch = samples_to_train_batch(
                samples,
                reward_key=self.cfg.reward.reward_key,
                estimator=algo.advantage_estimator,
                std_normalization=not algo.disable_grpo_std_normalization,
                disable_rewards_normalization=algo.disable_rewards_normalization,
            )
            shards = split_by_dp(batch, self.cfg.dp_size)
            return [shards[self.cfg.dp_rank_of(r)] for r in range(len(self.placement.trainer_specs))]

    async def train(self, rollout_id: int, shards: list[TrainBatch]) -> dict[str, float]:
        """One RL step on every trainer rank; its metrics (none without trainer)."""
        if not self.trainers:  # --debug-rollout-only: no trained weights, no new version
            return {}
        metrics = await self.timed("train_time", self.trainers.train(rollout_id, shards))
        self.trained_version = max(self.trained_version, self.weight_version) + 1
        return metrics

    # ---- checkpoints -----------------------------------------------------------------
    def _ckpt_dir(self, step: int) -> str:
        return os.path.join(self.cfg.train.save, f"iter_{step:07d}")

    async def maybe_save(self, rollout_id: int, *, force: bool = False) -> None:
        """At --save-interval steps and the last one: the checkpoint (--save) and the HF export (--save-hf),
        each when asked for; either works without the other."""
        t = self.cfg.train
        if not (t.save or t.save_hf):
            return
        last = self.cfg.rollout.num_rollout - 1
        if not force and not (t.save_interval and (rollout_id + 1) % t.save_interval == 0) and rollout_id != last:
            return
        if t.save:
            await self._save_checkpoint(rollout_id)
        if t.save_hf:
            path = t.save_hf.format(rollout_id=rollout_id)
            await self.timed("save_time", self.trainers.export_hf(path))

    async def _save_checkpoint(self, rollout_id: int) -> None:
        from miles.trainer.checkpoint_layout import prune_checkpoints

        t = self.cfg.train
        if rollout_id in self._saved_steps:
            return  # this run saved this step already (a stop signal right after a scheduled save)
        extra = {
            "rollout_id": rollout_id,
            "weight_version": max(self.trained_version, self.weight_version),
            "data_source": self.data_source.state_dict(),
            "pending_groups": self.pending_state_fn() if self.pending_state_fn else [],
        }
        # a full disk, say, is raised as the trainers' one-line reason, not their traceback
        await self.timed("save_time", self.trainers.save(self._ckpt_dir(rollout_id), extra))
        self._saved_steps.add(rollout_id)
        # with --async-save this one may still be being written: it is complete (and counted) at the next save
        if t.max_checkpoints:  # after the new one is complete: the newest complete checkpoint is never deleted
            await asyncio.to_thread(prune_checkpoints, t.save, t.max_checkpoints)

    async def finish_saves(self) -> None:
        """Wait for a checkpoint still being written in the background (--async-save); prune after it."""
        t = self.cfg.train
        if not (t.save and self._saved_steps):  # only a run with trainers saves
            return
        from miles.trainer.checkpoint_layout import prune_checkpoints

        await self.timed("save_time", self.trainers.finish_saves())
        if t.max_checkpoints:
            await asyncio.to_thread(prune_checkpoints, t.save, t.max_checkpoints)

    async def resume(self) -> None:
        """Restore the checkpoint --load (or --auto-resume) names; else start at --start-rollout-id."""
        from miles.trainer.checkpoint_layout import latest_complete_checkpoint, resolve_load_path

        t = self.cfg.train
        path = None
        if t.load:  # checked at start-up: a complete checkpoint, or the --save root of a run not saved yet
            path = resolve_load_path(t.load) if os.path.isdir(t.load) else None
        elif t.auto_resume and t.save:
            path = latest_complete_checkpoint(t.save)
        if path is None or not self.trainers:  # --debug-rollout-only refuses --load; it has no checkpoint
            self.start_rollout_id = self.cfg.rollout.start_rollout_id or 0
            return
        extra = await self.trainers.load(path)
        self.data_source.load_state_dict(extra["data_source"])
        pending = extra.get("pending_groups") or []
        if pending:  # prompts that were generating or buffered at save time: regenerate, never lose
            self.data_source.add_samples([[Sample.from_dict(d) for d in g] for g in pending])
        self.weight_version = self.trained_version = int(extra.get("weight_version", 0))
        self.start_rollout_id = int(extra["rollout_id"]) + 1
        logger.info("resumed from %s at rollout %d", path, self.start_rollout_id)

    # ---- profiling -------------------------------------------------------------------
    async def profile_hooks(self, rollout_id: int, phase: str) -> None:
        """Called at "start" and "end" of every step; opens / closes the --profile-steps windows."""
        if not self.profile:
            return
        if phase == "start" and not self._profiling:
            trace_dir = self.profile.starts_at(rollout_id)
            if trace_dir is not None:
                await self._all_workers("start_profile", trace_dir, py_spy=self.cfg.runtime.py_spy)
                self._profiling = True
                logger.info("profiling from rollout %d into %s", rollout_id, trace_dir)
        elif phase == "end" and self._profiling and self.profile.ends_at(rollout_id):
            await self._stop_profile()

    async def _stop_profile(self) -> None:
        self._profiling = False
        written = await self._all_workers("stop_profile")
        logger.info("profile traces: %s", [w["trace"] for w in written])

    async def _all_workers(self, method: str, *args: Any, **kwargs: Any) -> list:
        calls = [w.call(method, *args, **kwargs) for role in PROFILED_ROLES for w in self.runtime.workers(role)]
        return list(await asyncio.gather(*calls))

    # ---- metrics ---------------------------------------------------------------------
    def startup_mark(self, phase: str) -> None:
        """Close a start-up phase (perf/startup/<phase>) while the run has not begun its first step."""
        if self.startup is not None and not self.startup.done:
            self.startup.mark(phase)

    def begin_step(self) -> float:
        """The step's clock start: where the previous step's stopped, so that logging a step (its metrics, the
        system sample, the progress line) counts in the next one's time and overhead, as it delays it."""
        self._worker_wait_s = 0.0
        if self.startup is not None and not self.startup.done:
            self.startup.mark("eval_before_train")  # since the first push (0 when skipped)
            self._startup_metrics = self.startup.finish()  # launch to the start of the first step
            freeze_heap("controller ready")  # before the first step's clock starts
        return self._step_end if self._step_end is not None else time.perf_counter()

    def log_step(self, rollout_id: int, step_start: float, *parts: dict[str, float]) -> dict[str, float]:
        self._step_end = time.perf_counter()
        step_time = self._step_end - step_start
        metrics: dict[str, float] = {}
        for p in parts:
            metrics.update(p)
        metrics.update(self.timers.pop_all())
        metrics["perf/step_time"] = step_time
        metrics["perf/controller_overhead"] = max(0.0, step_time - self._worker_wait_s)
        metrics["perf/controller_overhead_fraction"] = metrics["perf/controller_overhead"] / max(step_time, 1e-9)
        metrics["rollout/weight_version"] = float(self.weight_version)
        metrics.update(self._startup_metrics)  # the first step's row carries the start-up
        self._startup_metrics = {}
        if self._last_push_metrics is not None:  # bytes the step's weight update moved (LoRA: the adapter only)
            metrics["perf/update_weights_bytes"] = float(self._last_push_metrics.get("perf/update_weights_bytes", 0.0))
            metrics.update((k, v) for k, v in self._last_push_metrics.items() if k.startswith("perf/peak_mem_gb/"))
            self._last_push_metrics = None
        metrics.update(self.sysmon.sample())
        self.sink.log(rollout_id, metrics)
        return metrics


def run_driver(train: Callable[[MilesConfig], Awaitable[str]], cfg: MilesConfig) -> int:
    """Run a loop driver's `train(cfg)` on uvloop (when installed), then print the reward curve."""
    from miles.utils.progress import print_reward_curve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out_dir = asyncio.run(train(cfg))
    key = "train/loss" if is_sft(cfg) else "rollout/reward_mean"
    print_reward_curve(out_dir, key=key, plots=cfg.logging.plot_curves)
    return 0
