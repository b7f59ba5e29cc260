"""Wiring a run: checks, workers, data, engines, weights, the gateway and the resume, each in the
order the next needs it. `start_run(cfg)` returns a `MilesRun` ready for the first step, or stops
every worker it started and raises.

The workers start (imports, model loads) while the data is read, validated and tokenised here: bad
data is refused as early as before, and the workers started meanwhile are stopped.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from miles.config import MilesConfig, engine_memory_tags, is_sft
from miles.controller.gateway import (
    check_session_server,
    engine_context_len,
    needs_gateway,
    point_plugins_at,
    start_rollout_gateway,
)
from miles.controller.machine import plan_run
from miles.controller.offload import resolve_offload
from miles.controller.opd import check_modes_before_start, start_teacher
from miles.controller.placement import Placement
from miles.controller.preflight import (
    PreflightError,
    RunData,
    check_attention_model,
    check_fp8_model,
    check_model_path,
    check_routing_replay_model,
    check_start,
    load_run_data,
    prompt_limit,
)
from miles.controller.router import EngineFleet, Router, engine_clients
from miles.controller.run import MilesRun
from miles.controller.run_dirs import clear_save_dir
from miles.controller.runtime import Runtime
from miles.controller.trainers import TrainerGroup
from miles.engines.client import EngineClient
from miles.engines.doors import new_api_key
from miles.trainer.moe_layout import check_megatron_model
from miles.utils.metrics import MetricsSink
from miles.utils.timer import StartupClock
from miles.wire.launch_env import LaunchEnv, runtime_options

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


async def start_run(cfg: MilesConfig) -> MilesRun:
    """Check the config and the machine, start the workers, connect everything; the run resumed when asked."""
    clock = StartupClock()  # before_run: imports, the config and model resolution in `miles train`
    le, machine = check_start(cfg)  # --load (or --auto-resume) checkpoint read whole here, NaN refused
    check_model_path(cfg.model)  # a directory: `miles train` resolved tiny:, smollm2: and Hub ids before
    check_routing_replay_model(cfg)
    check_attention_model(cfg)
    check_fp8_model(cfg)
    check_expert_layout(cfg)
    clear_save_dir(cfg.train)  # --overwrite-save: the old run's checkpoints go before this run saves
    cfg.engine.api_key = cfg.engine.api_key or new_api_key()  # one key per run: every engine and client
    placement = plan_run(cfg, machine, le)  # the workers' settings carry the model path and the key
    os.makedirs(cfg.runtime.output_dir, exist_ok=True)
    clock.mark("checks")
    runtime = await start_runtime(cfg, placement, le)
    try:
        return await _connect(cfg, runtime, placement, clock)
    except BaseException:
        await runtime.shutdown()
        raise


async def start_runtime(cfg: MilesConfig, placement: Placement, le: LaunchEnv) -> Runtime:
    """Spawn every planned worker without waiting for them to be ready."""
    return await Runtime.start(
        placement.specs,
        run_dir=cfg.runtime.output_dir,
        heartbeat_interval_s=cfg.runtime.heartbeat_interval_s,
        heartbeat_timeout_s=cfg.runtime.heartbeat_timeout_s,
        default_timeout_s=cfg.runtime.rpc_timeout_s,
        install_signal_handlers=False,
        wait_ready=False,
        **runtime_options(le),
    )


async def _connect(cfg: MilesConfig, runtime: Runtime, placement: Placement, clock: StartupClock) -> MilesRun:
    tokenizer, data = await asyncio.to_thread(read_run_data, cfg, placement)
    clock.mark("data")
    trainers = TrainerGroup(runtime, empty=not placement.trainer_specs)
    await _set_up_trainers(runtime, trainers, clock)
    if placement.colocated and trainers:
        await resolve_offload(cfg, trainers, placement.device)
    engines = await rollout_engines(cfg, runtime)
    router = Router(engines, session_mode=bool(cfg.rollout.use_session_server)) if engines else None
    run = MilesRun(cfg, runtime, placement, router, engines, tokenizer, open_sink(cfg), data)
    run.startup = clock
    run.eval_fleet = EngineFleet(await engine_clients(runtime, "eval_rollout", api_key=cfg.engine.api_key))
    run.teacher = await start_teacher(cfg, runtime, router)
    if trainers and engines:
        await connect_weights(cfg, run.trainers, [e.base_url for e in engines])
        run.weights_connected = True
    clock.mark("connect_weights")
    if router is not None and needs_gateway(cfg):  # session server + /generate for the plug-in layers
        context_len = engine_context_len(placement)
        run.gateway = await start_rollout_gateway(cfg, router, tokenizer, context_len)
        point_plugins_at(run.plugin_args, run.gateway, context_len)
    await run.resume()
    return run


async def _set_up_trainers(runtime: Runtime, trainers: TrainerGroup, clock: StartupClock) -> None:
    """The trainers load their model while the engines load theirs."""
    await runtime.wait_ready("trainer")
    setup = asyncio.ensure_future(trainers.setup())
    try:
        await runtime.wait_ready()
        clock.mark("workers")
        await setup
    finally:
        if not setup.done():
            setup.cancel()
    clock.mark("trainer_setup")  # what the trainers' set-up took beyond the engines' start


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


async def rollout_engines(cfg: MilesConfig, runtime: Runtime) -> list[EngineClient]:
    """Clients of the rollout engines (none under --debug-train-only and SFT)."""
    if cfg.runtime.debug_train_only or is_sft(cfg):
        return []
    return await engine_clients(
        runtime, "rollout", api_key=cfg.engine.api_key, external=cfg.engine.rollout_external_engine_addrs
    )


def open_sink(cfg: MilesConfig) -> MetricsSink:
    """The run's metrics sink: JSONL always, TensorBoard and Weights & Biases when asked for."""
    return MetricsSink(
        cfg.runtime.output_dir,
        tensorboard=cfg.logging.use_tensorboard,
        wandb_project=cfg.logging.wandb_project if cfg.logging.use_wandb else None,
        wandb_group=cfg.logging.wandb_group,
        run_name=cfg.runtime.run_name,
        config=cfg.to_dict(),
        wandb_mode=cfg.logging.wandb_mode,
        resume_from=cfg.train.load,
        checkpoint_root=cfg.train.save,
    )


async def connect_weights(cfg: MilesConfig, trainers: TrainerGroup, urls: list[str]) -> None:
    """Build every trainer rank's weight updater for the engines at `urls`."""
    # engines that release their weights between updates get a fresh weight buffer each time
    releases_weights = bool(cfg.train.offload_rollout) and "weights" in engine_memory_tags(
        cfg.train.offload_rollout_level
    )
    await trainers.connect_engines(
        urls,
        colocated=cfg.engine.colocate,
        keep_weight_mapping=not releases_weights,
    )


def check_expert_layout(cfg: MilesConfig) -> None:
    """The megatron expert layout (EP, expert-TP) against the model's experts, before any worker starts."""
    try:
        check_megatron_model(cfg.train, cfg.model.hf_checkpoint)
    except ValueError as e:
        raise PreflightError(str(e)) from None
