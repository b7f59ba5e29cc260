"""MilesRun: everything the loop drivers need behind a handful of awaitable calls.

The drivers (`loop_sync`, `loop_async`) read like the paper's pseudocode; this module owns the
machinery: spawning workers, the router, weight pushes, checkpoints, offload, eval, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from miles.config_checks import engine_memory_tags
from miles.config_lora_sft import is_sft
from miles.config_sections import MilesConfig
from miles.controller.gateway import check_session_server, engine_context_len, needs_gateway, start_rollout_gateway
from miles.controller.machine import plan_run
from miles.controller.opd import check_modes_before_start, start_teacher
from miles.controller.placement import Placement
from miles.controller.preflight import (
    PreflightError,
    RunData,
    check_model_path,
    check_routing_replay_model,
    check_start,
    load_run_data,
    prompt_limit,
)
from miles.controller.router import EngineFleet, Router, engine_clients
from miles.controller.run_dirs import clear_save_dir
from miles.controller.runtime import Runtime
from miles.controller.trainers import TrainerGroup
from miles.engines.client import EngineClient
from miles.engines.doors import new_api_key
from miles.errors import as_run_failure
from miles.rollout.opd_teacher import TeacherScorer
from miles.rollout.sample import Sample
from miles.rollout.train_data import TrainBatch, samples_to_train_batch, split_by_dp
from miles.trainer.moe_layout import check_megatron_model
from miles.utils.metrics import MetricsSink
from miles.utils.profiling import ProfileSchedule
from miles.utils.sysmon import SystemMonitor
from miles.utils.timer import StartupClock, StepTimers
from miles.wire.launch_env import runtime_options
from miles.wire.rpc import RemoteError
from miles.wire.specs import WorkerDied

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
PROFILED_ROLES = ("trainer", "rollout", "eval_rollout")  # worker roles that take start_profile / stop_profile


def read_run_data(cfg: MilesConfig, placement: Placement) -> tuple[PreTrainedTokenizerBase, RunData]:
    """The tokenizer and the run's prompts and eval sets, read, validated and tokenised."""
    from miles.utils.tokenizer_file import load_controller_tokenizer

    # tokenizer.json and the chat template without importing transformers where they match it (seconds
    # of start-up on slow file systems); transformers' tokenizer otherwise, and for anything else asked of it
    tokenizer = load_controller_tokenizer(cfg.model.hf_checkpoint, trust_remote_code=cfg.model.trust_remote_code)
    data = load_run_data(cfg, tokenizer, prompt_limit(cfg, placement))
    check_modes_before_start(cfg, tokenizer, data.prompts)  # OPD's teacher and routes, true-on-policy's model
    try:  # the session server's family (append-only on this tokenizer) and its matcher
        check_session_server(cfg, tokenizer)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if cfg.rollout.num_rollout is None:
        from miles.config import derive_num_rollout

        derive_num_rollout(cfg, len(data.prompts))
    return tokenizer, data


async def resolve_offload(cfg: MilesConfig, trainers: TrainerGroup) -> None:
    """Colocated offload left at its default: off when every trainer rank fits beside its engine.

    Off CUDA, or when a trainer cannot tell, offload stays on (the safe choice). Flags the user set
    are kept as they are.
    """
    t = cfg.train
    if t.offload_train is not None and t.offload_rollout is not None:
        return
    plans = await trainers.memory_plan()
    fits = all(p is not None and p["fits"] for p in plans)
    if plans[0] is not None:
        p = min(plans, key=lambda x: x["free_bytes"] - x["pending_state_bytes"] - x["activation_bytes"])
        logger.info(
            "colocated memory: %.1f of %.1f GiB free with the engines loaded; the trainer still needs %.1f GiB of "
            "state and up to %.1f GiB of activations: offload %s",
            p["free_bytes"] / 2**30,
            p["total_bytes"] / 2**30,
            p["pending_state_bytes"] / 2**30,
            p["activation_bytes"] / 2**30,
            "off (both fit)" if fits else "on",
        )
    if t.offload_train is None:
        t.offload_train = not fits
    if t.offload_rollout is None:
        t.offload_rollout = not fits


class MilesRun:
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
        self.args = cfg.flat()
        self.runtime = runtime
        self.trainers = TrainerGroup(runtime)
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
        # fully async runs save the prompts of buffered and in-flight groups with each checkpoint
        self.pending_state_fn = None
        self.eval_fleet = EngineFleet([])  # dedicated eval engines (--eval-mode dedicated), never updated by pushes
        self.teacher: TeacherScorer | None = None  # --use-opd: who scores the samples
        self.profile = ProfileSchedule(cfg.runtime.profile_steps, cfg.runtime.output_dir)
        self._profiling = False
        self.sysmon = SystemMonitor.for_local_workers(runtime, PROFILED_ROLES)
        # the debug modes start one side only: --debug-rollout-only no trainer, --debug-train-only no engine
        self.has_trainer = bool(placement.trainer_specs)
        self.startup: StartupClock | None = None
        self._startup_metrics: dict[str, float] = {}
        self.gateway = None  # the session server / router front for plug-ins, when the run needs one

    # ---- start / stop ----------------------------------------------------------------
    @classmethod
    async def start(cls, cfg: MilesConfig) -> MilesRun:
        clock = StartupClock()  # before_run: imports, the config and model resolution in `miles train`
        le, machine = check_start(cfg)  # --load (or --auto-resume) checkpoint read whole here, NaN refused
        check_model_path(cfg.model)  # a directory: `miles train` resolved tiny:, smollm2: and Hub ids before
        check_routing_replay_model(cfg)
        try:  # the megatron expert layout against the model's experts (moe_layout)
            check_megatron_model(cfg.train, cfg.model.hf_checkpoint)
        except ValueError as e:
            raise PreflightError(str(e)) from None
        clear_save_dir(cfg.train)  # --overwrite-save: the old run's checkpoints go before this run saves
        cfg.engine.api_key = cfg.engine.api_key or new_api_key()  # one key per run: every engine and client
        placement = plan_run(cfg, machine, le)  # the workers' settings carry the model path and the key
        run_dir = cfg.runtime.output_dir
        os.makedirs(run_dir, exist_ok=True)
        clock.mark("checks")
        # The workers start (imports, model loads) while the data is read, validated and tokenised here:
        # bad data is refused as early as before, and the workers started meanwhile are stopped.
        runtime = await Runtime.start(
            placement.specs,
            run_dir=run_dir,
            heartbeat_interval_s=cfg.runtime.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.runtime.heartbeat_timeout_s,
            default_timeout_s=cfg.runtime.rpc_timeout_s,
            install_signal_handlers=False,
            wait_ready=False,
            **runtime_options(le),
        )
        try:
            tokenizer, data = await asyncio.to_thread(read_run_data, cfg, placement)
            clock.mark("data")
            # the trainers load their model while the engines load theirs
            await runtime.wait_ready("trainer")
            trainers = TrainerGroup(runtime)
            setup = asyncio.ensure_future(trainers.setup() if placement.trainer_specs else asyncio.sleep(0))
            try:
                await runtime.wait_ready()
                clock.mark("workers")
                await setup
            finally:
                if not setup.done():
                    setup.cancel()
            clock.mark("trainer_setup")  # what the trainers' set-up took beyond the engines' start
            if placement.colocated and placement.trainer_specs:
                await resolve_offload(cfg, trainers)
            engines = (
                []
                if cfg.runtime.debug_train_only or is_sft(cfg)
                else await engine_clients(
                    runtime, "rollout", api_key=cfg.engine.api_key, external=cfg.engine.rollout_external_engine_addrs
                )
            )
            urls = [e.base_url for e in engines]
            router = Router(engines, session_mode=bool(cfg.rollout.use_session_server)) if engines else None
            sink = MetricsSink(
                run_dir,
                tensorboard=cfg.logging.use_tensorboard,
                wandb_project=cfg.logging.wandb_project if cfg.logging.use_wandb else None,
                wandb_group=cfg.logging.wandb_group,
                run_name=cfg.runtime.run_name,
                config=cfg.to_dict(),
                wandb_mode=cfg.logging.wandb_mode,
                resume_from=cfg.train.load,
                checkpoint_root=cfg.train.save,
            )
            run = cls(cfg, runtime, placement, router, engines, tokenizer, sink, data)
            run.startup = clock
            run.eval_fleet = EngineFleet(await engine_clients(runtime, "eval_rollout", api_key=cfg.engine.api_key))
            run.teacher = await start_teacher(cfg, runtime, router)
            # engines that release their weights between updates get a fresh weight buffer each time
            releases_weights = bool(cfg.train.offload_rollout) and "weights" in engine_memory_tags(
                cfg.train.offload_rollout_level
            )
            if placement.trainer_specs and engines:
                await run.trainers.connect_engines(
                    urls,
                    mode=cfg.weights.update_weight_transfer_mode,
                    colocated=cfg.engine.colocate,
                    keep_weight_mapping=not releases_weights,
                )
            clock.mark("connect_weights")
            if router is not None and needs_gateway(cfg):  # session server + /generate for the plug-in layers
                run.gateway = await start_rollout_gateway(
                    cfg, router, tokenizer, run.args, engine_context_len(placement)
                )
            await run._maybe_resume()
            return run
        except BaseException:
            await runtime.shutdown()
            raise

    async def close(self) -> None:
        if self._profiling:  # stopped inside a profile window: still write the traces
            await self._stop_profile()
        # a dead worker is reported once, by the run's own error; the debug modes never connected weights
        if self.runtime.failure is None and self.has_trainer and self.fleet:
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
    async def _wait(self, name: str, aw):
        """Await worker work, timing it as phase `name` and as time spent waiting on workers."""
        start = time.perf_counter()
        try:
            return await aw
        finally:
            dt = time.perf_counter() - start
            self.timers.add(name, dt)
            self._worker_wait_s += dt

    # ---- the loop's verbs ------------------------------------------------------------
    async def push_weights(self, version: int) -> None:
        """Pause engines, move the trainer's weights with the configured transport, continue."""
        if not self.has_trainer:  # --debug-rollout-only: the engines keep their initial weights
            return
        if not self.fleet:  # --debug-train-only: the trainer's weights move on; no engine to send them to
            self.weight_version = version
            return
        mode = self.cfg.weights.pause_generation_mode
        await self._wait("update_weights_time", self._push(version, mode))

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

    def to_train_batch(self, groups: list[list[Sample]]) -> list[TrainBatch]:
        """One shard per trainer rank (none under --debug-rollout-only): one per data-parallel replica,
        the same to every rank of a replica (its tensor- and pipeline-parallel peers)."""
        if not self.has_trainer:
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
        if not self.has_trainer:  # --debug-rollout-only
            return {}
        metrics = await self._wait("train_time", self.trainers.train(rollout_id, shards))
        self.trained_version = max(self.trained_version, self.weight_version) + 1
        return metrics

    async def offload_trainer(self) -> None:
        if self.placement.colocated and self.cfg.train.offload_train and self.has_trainer:
            await self._wait("offload_time", self.trainers.offload())

    async def onload_trainer(self) -> None:
        if self.placement.colocated and self.cfg.train.offload_train and self.has_trainer:
            await self._wait("offload_time", self.trainers.onload())

    async def release_engines(self) -> None:
        t = self.cfg.train
        if self.placement.colocated and t.offload_rollout and self.fleet:
            tags = engine_memory_tags(t.offload_rollout_level)
            await self._wait("offload_time", self.fleet.release_memory_occupation(tags))

    async def resume_engines(self) -> None:
        t = self.cfg.train
        if self.placement.colocated and t.offload_rollout and self.fleet:
            tags = engine_memory_tags(t.offload_rollout_level)
            await self._wait("offload_time", self.fleet.resume_memory_occupation(tags))

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
            await self._wait("save_time", self.trainers.export_hf(path))

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
        await self._wait("save_time", self.trainers.save(self._ckpt_dir(rollout_id), extra))
        self._saved_steps.add(rollout_id)
        # with --async-save this one may still be being written: it is complete (and counted) at the next save
        if t.max_checkpoints:  # after the new one is complete: the newest complete checkpoint is never deleted
            await asyncio.to_thread(prune_checkpoints, t.save, t.max_checkpoints)

    async def finish_saves(self) -> None:
        """Wait for a checkpoint still being written in the background (--async-save); prune after it."""
        t = self.cfg.train
        if not (t.save and self.has_trainer and self._saved_steps):
            return
        from miles.trainer.checkpoint_layout import prune_checkpoints

        await self._wait("save_time", self.trainers.finish_saves())
        if t.max_checkpoints:
            await asyncio.to_thread(prune_checkpoints, t.save, t.max_checkpoints)

    async def _maybe_resume(self) -> None:
        from miles.trainer.checkpoint_layout import latest_complete_checkpoint, resolve_load_path

        t = self.cfg.train
        path = None
        if t.load:  # checked at start-up: a complete checkpoint, or the --save root of a run not saved yet
            path = resolve_load_path(t.load) if os.path.isdir(t.load) else None
        elif t.auto_resume and t.save:
            path = latest_complete_checkpoint(t.save)
        if path is None or not self.has_trainer:  # --debug-rollout-only refuses --load; it has no checkpoint
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
    def begin_step(self) -> float:
        self._worker_wait_s = 0.0
        if self.startup is not None and not self.startup.done:
            self.startup.mark("first_push")  # the engines' first weights and the before-training eval
            self._startup_metrics = self.startup.finish()  # launch to the start of the first step
        return time.perf_counter()

    def log_step(self, rollout_id: int, step_start: float, *parts: dict[str, float]) -> dict[str, float]:
        step_time = time.perf_counter() - step_start
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
    print_reward_curve(out_dir, key="train/loss" if is_sft(cfg) else "rollout/reward_mean")
    return 0
