"""Start-up checks that touch the filesystem, run by the controller: paths and plug-ins before any worker
starts, the data while the workers start (they are stopped when it is refused).

A run that cannot succeed is refused here in one line naming the path and the fix, instead of
after the workers started or at the first save: `--hf-checkpoint` must be a model directory,
`--load` must name a checkpoint, `--save` must be writable, every plug-in path must import, and the
prompt data (and eval data) must parse, decode as UTF-8 and fit the engines.
The data is read and tokenised here once; the sources built here are the ones the run draws from.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from miles.agent.plugins import PLUGIN_CHECKS, PluginShapeError
from miles.config import FIELDS, MilesConfig, ModelConfig, is_sft
from miles.config.rules.derive import fp8_serving
from miles.controller.machine import Machine, plan_run, resolve_machine
from miles.controller.placement import Placement
from miles.controller.run_dirs import RunDirError, check_save_reuse
from miles.rollout.data_source import DataSource, JsonlDataSource, load_data_source
from miles.rollout.prompt_rows import DataError, PromptLimit
from miles.rollout.sft_data import SupervisedDataSource
from miles.utils.misc import PluginError, load_function, missing_file_line
from miles.wire.launch_env import LaunchEnv, launch_env, with_controller_flags

logger = logging.getLogger(__name__)


class PreflightError(ValueError):
    """A start-up check failed; the message is one line with what was wrong and the fix."""


def check_start(cfg: MilesConfig, *, scan_load_weights: bool = True) -> tuple[LaunchEnv, Machine]:
    """Every start-up check that needs no model and starts nothing: the controller address, the machine
    and a layout it can hold, checkpoint and plug-in paths, the train backend. `miles train` runs it before
    it resolves the model (a bad layout costs no model build); `setup.start_run` runs it again, cheaply, for
    callers that come straight. `scan_load_weights`: read the resumed checkpoint's weights for NaN/inf
    (`miles train` leaves that to the second call, so the weights are read once)."""
    le = controller_address(cfg.runtime, launch_env())  # --controller-host/-port over the environment
    machine = resolve_machine(cfg.runtime, le)
    placement = plan_run(cfg, machine, le)  # a layout the cluster cannot hold is refused here, before any work
    check_checkpoint_paths(cfg.train.load, cfg.train.save, cfg.train.save_hf)
    try:
        check_save_reuse(cfg.train)  # a fresh run never shares --save with another run's checkpoints
    except RunDirError as e:
        raise PreflightError(str(e)) from None
    check_resume_checkpoint(cfg.train, scan_weights=scan_load_weights)
    check_plugin_paths(cfg)  # every plug-in imports once here: a bad path costs no worker start-up
    check_data_paths(cfg)  # the files are read while the workers start; one that is not there stops nothing
    check_train_backend(cfg, placement)
    return le, machine


# ---------------------------------------------------------------- model and checkpoint paths


def check_model_path(model: ModelConfig) -> None:
    """`--hf-checkpoint` is a model directory by now (`miles.models.resolve` turns specs into directories),
    with the config.json every Hugging Face model directory has."""
    path = model.hf_checkpoint
    if not path or not os.path.isdir(os.path.expanduser(path)):
        raise PreflightError(
            f"--hf-checkpoint {path!r} is not a model directory; resolve it first with "
            "miles.models.resolve.resolve_model_paths (miles train does) or pass a directory"
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        what = "is an empty directory" if not os.listdir(os.path.expanduser(path)) else "has no config.json"
        raise PreflightError(
            f"--hf-checkpoint {path!r} {what}; point it at a Hugging Face model directory (config.json, tokenizer "
            "files, *.safetensors), a Hub id (org/name) or a tiny:ARCH spec"
        )


def _model_config(cfg: MilesConfig) -> dict:
    """The resolved model's config.json (empty when there is none to read)."""
    path = os.path.join(cfg.model.hf_checkpoint or "", "config.json")
    return json.loads(Path(path).read_text()) if cfg.model.hf_checkpoint and os.path.isfile(path) else {}


def _num_experts(model_cfg: dict) -> int:
    """Routed experts per MoE layer, under any of the names configs use (0: a dense model)."""
    return int(
        model_cfg.get("num_experts") or model_cfg.get("num_local_experts") or model_cfg.get("n_routed_experts") or 0
    )


def check_routing_replay_model(cfg: MilesConfig) -> None:
    """--use-(rollout-)routing-replay needs a mixture-of-experts model: refused, in one line, for a dense one."""
    t = cfg.train
    if not t.use_routing_replay or not cfg.model.hf_checkpoint:
        return
    model_cfg = _model_config(cfg)
    if not _num_experts(model_cfg):
        flag = "--use-rollout-routing-replay" if t.use_rollout_routing_replay else "--use-routing-replay"
        raise PreflightError(
            f"{flag}: {cfg.model.hf_checkpoint} is a dense {model_cfg.get('model_type', '?')} model with no experts "
            "to route; drop the flag (it is for mixture-of-experts models such as qwen3_moe)"
        )


def check_attention_model(cfg: MilesConfig) -> None:
    """--attn-implementation miles_varlen names a kernel for causal-attention families only: refused, in one
    line, for a model it cannot serve (auto falls back to SDPA by itself)."""
    from miles.trainer import attention_models

    if cfg.train.attn_implementation != attention_models.NAME or not cfg.model.hf_checkpoint:
        return
    why = "remote-code model" if cfg.model.trust_remote_code else attention_models.unsupported(_model_config(cfg))
    if why is not None:
        raise PreflightError(
            f"--attn-implementation {attention_models.NAME} cannot serve {cfg.model.hf_checkpoint}: {why}; "
            "use auto (SDPA where miles_varlen cannot run) or sdpa"
        )


def check_fp8_model(cfg: MilesConfig) -> None:
    """FP8 serving in the embedded engine covers dense models: a MoE checkpoint is refused, in one line, before
    the engines start (they would refuse it while loading)."""
    if cfg.engine.engine != "embedded" or not fp8_serving(cfg) or not cfg.model.hf_checkpoint:
        return
    model_cfg = _model_config(cfg)
    if _num_experts(model_cfg):
        raise PreflightError(
            f"FP8 serving: {cfg.model.hf_checkpoint} is a mixture-of-experts {model_cfg.get('model_type', '?')} "
            "model and the embedded engine serves FP8 for dense models only; serve it in bf16 (drop "
            "--sglang-quantization fp8) or with --engine sglang"
        )


def check_checkpoint_paths(load: str | None, save: str | None, save_hf: str | None) -> None:
    """`--load` names a complete checkpoint (or is the `--save` root of a run not saved yet); outputs are writable."""
    if load:
        _check_load(load, resumes_save=bool(save) and os.path.realpath(load) == os.path.realpath(save))
    if save:
        _check_writable(save, "--save")
    if save_hf:
        _check_writable(os.path.dirname(os.path.abspath(save_hf.format(rollout_id=0))), "--save-hf")


def _check_load(load: str, *, resumes_save: bool) -> None:
    from miles.trainer.checkpoint_layout import COMPLETE_MARKER, is_complete, resolve_load_path

    fix = "or drop --load to start from --hf-checkpoint"
    if os.path.exists(load) and not os.path.isdir(load):
        raise PreflightError(f"--load {load!r} is a file; point it at an iter_* directory or a --save root, {fix}")
    resolved = resolve_load_path(load) if os.path.isdir(load) else None
    if resolved is not None and is_complete(resolved):
        return
    if resumes_save:  # Miles' requeue idiom `--load X --save X`: the first job finds nothing yet
        logger.info("no checkpoint under --load %s (also --save) yet: starting from --hf-checkpoint", load)
        return
    if not os.path.exists(load):
        raise PreflightError(
            f"--load {load!r} does not exist; point it at a checkpoint (an iter_* directory or a --save root), {fix}"
        )
    if resolved is not None:
        raise PreflightError(
            f"--load {load!r} has no {COMPLETE_MARKER} marker (an interrupted save); "
            f"point it at a complete iter_* directory or at its --save root, {fix}"
        )
    raise PreflightError(
        f"--load {load!r} holds no complete checkpoint (no iter_*/{COMPLETE_MARKER}); "
        f"point it at the --save root of a finished save, {fix}"
    )


def check_resume_checkpoint(train: Any, *, scan_weights: bool = True) -> None:
    """The checkpoint the run will resume from (`--load`, or the newest under `--save` with `--auto-resume`)
    is whole: marker, meta.json, model metadata and shard files, and with `scan_weights` finite weights."""
    from miles.trainer.checkpoint_layout import latest_complete_checkpoint, resolve_load_path
    from miles.trainer.checkpoint_verify import CheckpointInvalid, verify_checkpoint

    if train.load:
        path, flag = (resolve_load_path(train.load) if os.path.isdir(train.load) else None), "--load"
    else:
        path, flag = (latest_complete_checkpoint(train.save) if train.auto_resume and train.save else None), "--save"
    if path is None:
        return
    try:
        verify_checkpoint(path, scan_weights=scan_weights)
    except CheckpointInvalid as e:
        fix = (
            "point --load at another checkpoint or drop it" if flag == "--load" else "remove it or drop --auto-resume"
        )
        raise PreflightError(f"{flag}: {e}; {fix}") from None


def _check_writable(directory: str, flag: str) -> None:
    """Create `directory` and a file in it, as the first save will."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".miles-write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(
            f"{flag} {directory!r} is not writable ({e.strerror or e}); point {flag} at a directory you can write"
        ) from None


# ---------------------------------------------------------------- controller address


def controller_address(runtime: Any, le: LaunchEnv) -> LaunchEnv:
    """The launch position with `--controller-host` / `--controller-port` applied; refused on one node,
    where the controller and its workers talk over IPC and no address is used."""
    given = [
        f
        for f, v in (("--controller-host", runtime.controller_host), ("--controller-port", runtime.controller_port))
        if v
    ]
    if given and le.num_nodes == 1:
        raise PreflightError(
            f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to multi-node runs started with python -m miles.launch; this run has one "
            "node, where the workers talk to the controller over IPC: drop them"
        )
    return with_controller_flags(le, runtime.controller_host, runtime.controller_port)


# ---------------------------------------------------------------- plug-in paths

# Fields the run resolves with `load_function`, in the controller or in a worker.
PLUGIN_FIELDS: tuple[str, ...] = (
    "rollout_function_path",
    "custom_generate_function_path",
    "custom_agent_function_path",
    "data_source_path",
    "dynamic_sampling_filter_path",
    "rollout_sample_filter_path",
    "custom_rm_path",
    "group_reward_path",
    "custom_loss_function_path",
    "custom_tis_function_path",
    "custom_async_data_buffer_path",
)


def check_plugin_paths(cfg: MilesConfig) -> None:
    """Import every plug-in the run names, so a mistyped path fails now and not at the step that calls it."""
    for name in PLUGIN_FIELDS:
        path = cfg.get(name)
        if not path:
            continue
        flag = FIELDS[name].flag
        try:
            obj = load_function(path)
        except PluginError as e:
            reason = " ".join(str(e).split())  # one line, whatever the import error printed
            raise PreflightError(
                f"{flag} {path!r} does not load: {reason}; fix the path ('pkg.module:attr' or 'pkg.module.attr') "
                "or make its module importable (install it or add its directory to PYTHONPATH)"
            ) from None
        if not callable(obj):
            raise PreflightError(
                f"{flag} {path!r} resolved to a {type(obj).__name__}, which cannot be called; "
                "point it at a function or class"
            )
        if name in PLUGIN_CHECKS:  # the plug-in layers are called with fixed signatures: check them now
            try:
                PLUGIN_CHECKS[name](obj)
            except PluginShapeError as e:
                raise PreflightError(f"{flag} {path!r} cannot be used: {e}") from None


def check_train_backend(cfg: MilesConfig, placement: Placement) -> None:
    """`--train-backend megatron` needs megatron-core where the trainers run, and GPUs;
    `--attn-implementation flash_attention_2` needs flash-attn."""
    import importlib.util

    if cfg.train.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise PreflightError(
            "--attn-implementation flash_attention_2 needs the flash-attn package, which is not installed; "
            "use auto (torch's own varlen flash kernel where it runs) or pip install flash-attn"
        )
    if cfg.train.train_backend != "megatron" or not placement.trainer_specs:
        return

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise PreflightError(
            "--train-backend megatron needs megatron-core, which is not installed; pip install 'miles[megatron]' "
            "(megatron-core 0.19.2, Python >= 3.12), or use --train-backend fsdp"
        )
    if placement.device != "cuda":
        raise PreflightError(
            "--train-backend megatron runs on CUDA GPUs with NCCL and this is a CPU plan; use --train-backend fsdp "
            "on CPU, or run where GPUs are visible (--num-gpus-per-node)"
        )


# ---------------------------------------------------------------- prompt length limit


def prompt_limit(cfg: MilesConfig, placement: Placement) -> PromptLimit | None:
    """The most prompt tokens the run can take: the smallest of `--rollout-max-prompt-len`, the context
    of every planned engine (which refuses a longer prompt at the step that draws it) and the model's
    positions."""
    limits = []
    if cfg.data.rollout_max_prompt_len is not None:
        limits.append(PromptLimit(cfg.data.rollout_max_prompt_len))
    for spec in placement.specs:
        kw = spec.init_kwargs
        if spec.role not in ("rollout", "eval_rollout"):
            continue
        if kw.get("engine") == "embedded" and kw.get("max_total_tokens"):
            per_request = kw["max_total_tokens"] // kw["max_running_requests"]
            limits.append(
                PromptLimit(
                    per_request - 1,
                    f"the engine's {per_request}-token context per request "
                    "(--max-total-tokens / --max-running-requests; or set --rollout-max-prompt-len)",
                )
            )
        elif kw.get("sglang_args", {}).get("context_length"):
            ctx = int(kw["sglang_args"]["context_length"])
            limits.append(PromptLimit(ctx - 1, f"--sglang-context-length={ctx}"))
    positions = _max_positions(cfg.model.hf_checkpoint)
    if positions:
        limits.append(PromptLimit(positions - 1, f"the model's max_position_embeddings={positions}"))
    return min(limits, key=lambda limit: limit.max_tokens) if limits else None


def _max_positions(model_dir: str | None) -> int | None:
    path = os.path.join(model_dir or "", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        value = json.load(f).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 1 else None


# ---------------------------------------------------------------- data


@dataclass(slots=True)
class RunData:
    """What the run draws from: the training prompts and every eval set, read and checked once."""

    prompts: DataSource
    eval_sets: dict[str, JsonlDataSource]


def check_data_paths(cfg: MilesConfig) -> None:
    """The prompt and eval files exist: their contents are read beside the workers' start-up, but a path that
    names no file is refused before any worker starts, as the reader would refuse it."""
    paths: list[tuple[str, str]] = []
    if cfg.data.prompt_data and not cfg.data.data_source_path:  # a custom source reads what it likes
        paths.append(("prompt data", cfg.data.prompt_data))
    if wants_eval_data(cfg) and len(cfg.eval.eval_prompt_data) % 2 == 0:  # a bad pairing is refused on reading
        paths += [(f"eval data {name!r}:", path) for name, path in parse_eval_datasets(cfg.eval.eval_prompt_data)]
    for what, path in paths:
        if not Path(path).is_file():
            raise PreflightError(missing_file_line(what, path))


def parse_eval_datasets(items: list[str]) -> list[tuple[str, str]]:
    """`--eval-prompt-data name path [name path ...]` as (name, path) pairs."""
    if len(items) % 2:
        raise ValueError(f"--eval-prompt-data takes pairs 'name path', got {items!r}")
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


def wants_eval_data(cfg: MilesConfig) -> bool:
    """Eval sets are read when the loop will evaluate on them (not for an external eval command)."""
    e = cfg.eval
    external = cfg.async_.fully_async and e.eval_mode == "external"
    return bool(e.eval_interval and e.eval_prompt_data and not external)


def load_run_data(cfg: MilesConfig, tokenizer: Any, limit: PromptLimit | None) -> RunData:
    """Read, validate and tokenise the prompt and eval data; refuse with PreflightError on bad data."""
    try:
        if is_sft(cfg):  # prompt/response rows, tokenised with their loss masks (rollout/sft_data.py)
            prompts: DataSource = SupervisedDataSource(cfg.data, tokenizer=tokenizer, prompt_limit=limit)
        else:
            prompts = load_data_source(
                cfg.data,
                n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                tokenizer=tokenizer,
                prompt_limit=limit,
            )
        eval_sets: dict[str, JsonlDataSource] = {}
        if wants_eval_data(cfg):
            for name, path in parse_eval_datasets(cfg.eval.eval_prompt_data):
                data = replace(cfg.data, prompt_data=path, rollout_shuffle=False)
                eval_sets[name] = JsonlDataSource(
                    data,
                    n_samples_per_prompt=cfg.eval.n_samples_per_eval_prompt,
                    tokenizer=tokenizer,
                    prompt_limit=limit,
                )
    except DataError as e:
        raise PreflightError(str(e)) from None
    return RunData(prompts, eval_sets)
