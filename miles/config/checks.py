"""Derivations and start-up validation of a parsed `MilesConfig`.

Three passes, in order: the four-knob batch invariant, the defaults that depend on other flags,
then every invalid combination. Problems are collected and raised together as one ConfigError,
each naming the flags involved, the values seen and what to change.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING

from miles.config.fields import FIELDS, ConfigError
from miles.config.ranges import (
    CHECKED_ELSEWHERE,
    MACHINE_LIMITS,
    MAX_SAMPLES_PER_STEP,
    NUMBER_RANGES,
    in_range,
    machine_errors,
)
from miles.config.rules.lora_sft import check_lora, check_sft, is_sft
from miles.config.rules.memory import check_memory_levers
from miles.config.rules.modes import check_mode_support, check_not_implemented
from miles.config.sections import ENGINE_DTYPES

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

logger = logging.getLogger(__name__)

KNOBS = ("rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout")
EQUATION = "rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout"

ENUM_CHOICES: dict[str, tuple[str, ...]] = {
    "advantage_estimator": ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"),
    "loss_type": ("policy_loss", "sft_loss", "custom_loss"),
    "kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "tis_mode": ("clamp", "clip_or_pop"),
    "loss_aggregation": ("sample_mean", "token_mean", "seq_mean_token_sum"),
    "pause_generation_mode": ("abort", "in_place", "retract"),
    "update_weight_transfer_mode": ("broadcast", "p2p", "disk-delta"),
    "update_weight_delta_encoding": ("xor", "overwrite"),
    "update_weight_digest": ("xxh3-128", "blake2b", "adler32"),
    "engine": ("embedded", "sglang"),
    "train_backend": ("fsdp", "megatron"),
    "lr_decay_style": ("constant", "linear", "cosine"),
    "dtype": ("auto", "bfloat16", "float16", "float32"),
    "reward_phase": ("inline", "separate"),
    "rollout_submission_granularity": ("group", "sample"),
    "eval_mode": ("shared", "dedicated", "external"),
    "async_unused_samples_handler": ("retry", "drop"),
    "async_staleness_policy": ("drop", "pace"),
    "wandb_mode": ("online", "offline", "disabled"),
    "use_session_server": ("v1", "v2"),
    "opd_type": ("sglang", "megatron"),
    "opd_top_k_strategy": ("only-student", "only-teacher", "intersection", "union", "xor"),
    "opd_reward_weight_mode": ("student_p", "teacher_p", "none"),
    "stream_optimizer_state_moment_dtype": ("fp32", "bf16"),
    "offload_train_target": ("cpu", "disk"),
}
DEFAULT_TEACHER = "default"  # the teacher a prompt without a known teacher name goes to


def flag(name: str) -> str:
    return FIELDS[name].flag


# ---------------------------------------------------------------- four-knob invariant


def resolve_batch_knobs(cfg: MilesConfig, explicit: set[str]) -> list[str]:
    """Fill the missing knob of rbs × n = gbs × steps, or report why it cannot hold."""
    r = cfg.rollout
    known = {
        k: getattr(r, k) for k in KNOBS if getattr(r, k) is not None and (k in explicit or k != "n_samples_per_prompt")
    }
    bad = [f"{flag(k)}={v} must be a positive integer" for k, v in known.items() if v <= 0]
    if bad:
        return bad
    # Too few to derive anything: take the group size's default (1), then one optimizer step per rollout.
    for knob, default in (("n_samples_per_prompt", 1), ("num_steps_per_rollout", 1)):
        if len(known) < 3 and knob not in known:
            known[knob] = default
    for knob in ("n_samples_per_prompt", "num_steps_per_rollout"):
        if knob in known:
            setattr(r, knob, known[knob])
    if len(known) < 3:
        return []  # neither rollout_batch_size nor global_batch_size: reported by the train checks
    if len(known) == 4:
        return _check_four(known)
    missing = next(k for k in KNOBS if k not in known)
    value, error = _derive_knob(missing, known)
    if error:
        return [error]
    setattr(r, missing, value)
    logger.info("derived %s=%d from %s", missing, value, EQUATION)
    return []


def _check_four(k: dict[str, int]) -> list[str]:
    rbs, n, gbs, steps = (k[name] for name in KNOBS)
    if rbs * n == gbs * steps:
        return []
    return [
        f"the batch knobs are inconsistent: rollout_batch_size={rbs} × n_samples_per_prompt={n} = {rbs * n}, but "
        f"global_batch_size={gbs} × num_steps_per_rollout={steps} = {gbs * steps}; {EQUATION} must hold. "
        "Give only three of --rollout-batch-size, --n-samples-per-prompt, --global-batch-size, "
        "--num-steps-per-rollout and the fourth is derived"
    ]


# missing knob -> (the two knobs of the other side of the equation, the knob sharing its side)
_DERIVE = {
    "global_batch_size": (("rollout_batch_size", "n_samples_per_prompt"), "num_steps_per_rollout"),
    "num_steps_per_rollout": (("rollout_batch_size", "n_samples_per_prompt"), "global_batch_size"),
    "rollout_batch_size": (("global_batch_size", "num_steps_per_rollout"), "n_samples_per_prompt"),
    "n_samples_per_prompt": (("global_batch_size", "num_steps_per_rollout"), "rollout_batch_size"),
}


def _derive_knob(missing: str, k: dict[str, int]) -> tuple[int, str | None]:
    (a, b), divisor_name = _DERIVE[missing]
    total, divisor = k[a] * k[b], k[divisor_name]
    if total % divisor:
        return 0, (
            f"cannot derive {missing} from {EQUATION}: {a} × {b} = {k[a]} × {k[b]} = {total} is not divisible by "
            f"{divisor_name}={divisor}; set {flag(divisor_name)} to a divisor of {total}, or give {flag(missing)}"
        )
    return total // divisor, None


def derive_num_rollout(cfg: MilesConfig, dataset_len: int) -> int:
    """num_rollout = num_epoch × dataset_len // rollout_batch_size, once the dataset length is known."""
    if cfg.rollout.num_rollout is not None:
        return cfg.rollout.num_rollout
    epochs, rbs = cfg.data.num_epoch, cfg.rollout.rollout_batch_size
    if epochs is None or rbs is None:
        raise ConfigError("cannot derive --num-rollout: give --num-rollout, or --num-epoch with --rollout-batch-size")
    steps = epochs * dataset_len // rbs
    if steps < 1:
        raise ConfigError(
            f"--num-epoch={epochs} over {dataset_len} prompts with --rollout-batch-size={rbs} gives 0 rollout steps; "
            f"lower --rollout-batch-size to at most {epochs * dataset_len} or raise --num-epoch"
        )
    cfg.rollout.num_rollout = steps
    return steps


# ---------------------------------------------------------------- derived defaults


def apply_derivations(cfg: MilesConfig, explicit: set[str]) -> None:
    r, a = cfg.rollout, cfg.algo
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip
    if r.over_sampling_batch_size is None:
        r.over_sampling_batch_size = r.rollout_batch_size
    if cfg.train.true_on_policy_mode and a.loss_type != "sft_loss" and not r.rollout_function_path:
        r.recompute_logprobs_via_prefill = True  # the rollout's log-probs come from the reference forward
    if cfg.train.use_rollout_routing_replay:
        cfg.train.use_routing_replay = True  # as Miles: the rollout's routing replaces the first pass's record
    if r.n_samples_per_prompt == 1 and not a.disable_grpo_std_normalization:
        a.disable_grpo_std_normalization = True  # the std of a single sample is 0
    if r.rollout_submission_granularity is None:
        r.rollout_submission_granularity = "sample" if cfg.async_.fully_async else "group"
    if not cfg.engine.colocate:  # colocated, None stays: decided from the GPUs' memory once both sides are up
        cfg.train.offload_train = bool(cfg.train.offload_train)
        cfg.train.offload_rollout = bool(cfg.train.offload_rollout)
    if a.loss_aggregation is None:
        a.loss_aggregation = "token_mean" if a.calculate_per_token_loss else "sample_mean"
    if cfg.model.ref_load is None and (a.use_kl_loss or a.kl_coef != 0):
        cfg.model.ref_load = cfg.model.hf_checkpoint
    if a.advantage_estimator == "ppo" and cfg.model.critic_load is None:
        cfg.model.critic_load = cfg.model.hf_checkpoint
    if cfg.train.critic_lr is None:
        cfg.train.critic_lr = cfg.train.lr
    if cfg.data.rollout_max_prompt_len is None and r.rollout_max_context_len is not None:
        cfg.data.rollout_max_prompt_len = r.rollout_max_context_len - 1
    if cfg.runtime.output_dir is None:
        cfg.runtime.output_dir = f"runs/{cfg.runtime.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    fp8_rollouts = serves_fp8(cfg.model.hf_checkpoint) or cfg.engine.sglang_args.get("quantization") == "fp8"
    if "use_tis" not in explicit and not a.use_rollout_logprobs and fp8_rollouts:
        a.use_tis = True  # FP8 rollouts of a bf16 policy: TIS absorbs the mismatch (--no-use-tis opts out)


def serves_fp8(checkpoint: str | None) -> bool:
    """Whether the engines' checkpoint is an FP8 rollout checkpoint (its config.json's quantization_config)."""
    path = os.path.join(checkpoint, "config.json") if checkpoint else ""
    if not path or not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return quant.get("quant_method") == "fp8"


def resolve_rollout_engines(cfg: MilesConfig, explicit: set[str]) -> list[str]:
    """Miles' `--rollout-num-gpus` G: G / --rollout-num-gpus-per-engine engines. Under --colocate Miles sets G
    to the trainer's GPUs, so a G that says otherwise is refused rather than ignored."""
    e, gpus = cfg.engine, cfg.engine.rollout_num_gpus
    if gpus is None:
        return []
    k, trainer_gpus = e.rollout_num_gpus_per_engine, cfg.trainer_world_size
    if e.colocate and gpus != trainer_gpus:
        return [
            f"--rollout-num-gpus={gpus} with --colocate: the engines share the trainer's {trainer_gpus} GPU(s) "
            f"(Miles sets --rollout-num-gpus to that count); drop it or set it to {trainer_gpus}"
        ]
    if gpus < 1 or k < 1 or gpus % k:
        return [
            f"--rollout-num-gpus={gpus} is not a positive multiple of --rollout-num-gpus-per-engine={k}; "
            f"pick a multiple of {k}"
        ]
    engines = gpus // k
    if "rollout_num_engines" in explicit and e.rollout_num_engines != engines:
        return [
            f"--rollout-num-engines={e.rollout_num_engines} disagrees with --rollout-num-gpus={gpus} / "
            f"--rollout-num-gpus-per-engine={k} = {engines} engine(s); give only one of the two"
        ]
    e.rollout_num_engines = engines
    return []


# ---------------------------------------------------------------- validation


OFFLOAD_ROLLOUT_LEVELS = {
    "kv_cache": "kv_cache",
    "weight": "weights",
    "weights": "weights",
    "cuda_graph": "cuda_graph",
}


def engine_memory_tags(levels: list[str]) -> list[str]:
    """`--offload-rollout-level` values as the engines' memory tags (Miles' `weight` is the tag `weights`)."""
    return sorted({OFFLOAD_ROLLOUT_LEVELS[level] for level in levels})


def check_enums(cfg: MilesConfig) -> list[str]:
    errors = []
    bad = [level for level in cfg.train.offload_rollout_level if level not in OFFLOAD_ROLLOUT_LEVELS]
    if bad:
        errors.append(f"--offload-rollout-level {' '.join(bad)}: use any of kv_cache, weight, cuda_graph")
    for name, choices in ENUM_CHOICES.items():
        value = cfg.get(name)
        if value is None or value in choices:
            continue
        near = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        errors.append(f"{flag(name)}={value!r} is not one of {', '.join(choices)}{hint}")
    return errors


def _lora_rank(cfg: MilesConfig) -> int:
    """LoRA rank if a `lora_rank` field exists in any section (LoRA support adds it), else 0."""
    return (cfg.get("lora_rank") or 0) if "lora_rank" in FIELDS else 0


def check_modes(cfg: MilesConfig) -> list[str]:
    """Combinations of colocation, async, pause and transfer modes that cannot work together."""
    e: list[str] = []
    fully_async, colocate = cfg.async_.fully_async, cfg.engine.colocate
    pause, transfer = cfg.weights.pause_generation_mode, cfg.weights.update_weight_transfer_mode
    if fully_async and colocate:
        e.append("--fully-async needs separate trainer and engine devices; drop --colocate or --fully-async")
    if pause == "abort" and cfg.rollout.use_session_server:
        e.append(
            "--pause-generation-mode=abort loses session turns with --use-session-server; use --pause-generation-mode retract or in_place"
        )
    if fully_async and pause == "abort":
        e.append("--fully-async with --pause-generation-mode=abort drops in-flight samples; use retract or in_place")
    if fully_async and cfg.rollout.partial_rollout:
        e.append("--fully-async already keeps unfinished samples; drop --partial-rollout")
    if transfer == "disk-delta" and colocate:
        e.append("--update-weight-transfer-mode=disk-delta is for separate devices; with --colocate use broadcast")
    if transfer == "disk-delta" and _lora_rank(cfg) > 0:
        e.append("--update-weight-transfer-mode=disk-delta does not support LoRA (--lora-rank > 0); use broadcast")
    if cfg.weights.check_weight_update_allow_quant_error and not cfg.weights.check_weight_update_equal:
        e.append(
            "--check-weight-update-allow-quant-error sets how --check-weight-update-equal compares; add that flag or drop it"
        )
    if transfer == "p2p" and colocate:
        e.append("--update-weight-transfer-mode=p2p is for separate devices; with --colocate use broadcast")
    return e


# Set by the engine launcher from Miles' own flags; a passthrough copy would conflict.
SGLANG_RESERVED = {
    "model_path": "--hf-checkpoint",
    "host": "the launcher",
    "port": "the launcher",
    "tp_size": "--rollout-num-gpus-per-engine",
    "tp": "--rollout-num-gpus-per-engine",
}


# The SGLang server flags the embedded engine reads as SGLang does; any other --sglang-* flag would be
# dropped by it, so that engine refuses them.
EMBEDDED_SGLANG_ARGS = ("disable_cuda_graph", "disable_radix_cache", "dtype", "quantization")


def check_sglang_passthrough(cfg: MilesConfig) -> list[str]:
    args = cfg.engine.sglang_args
    e = [
        f"--sglang-{key.replace('_', '-')} is set by Miles from {owner}; drop the passthrough flag"
        for key, owner in SGLANG_RESERVED.items()
        if key in args
    ]
    if cfg.engine.engine == "embedded" and args.get("quantization") not in (None, "fp8"):
        e.append(
            f"--sglang-quantization={args['quantization']!r}: the embedded engine serves fp8 only; use fp8 or --engine sglang"
        )
    if "dtype" in args and str(args["dtype"]) not in ENGINE_DTYPES:
        e.append(f"--sglang-dtype={args['dtype']!r} is not one of SGLang's: {', '.join(ENGINE_DTYPES)}")
    unread = [key for key in args if key not in EMBEDDED_SGLANG_ARGS and key not in SGLANG_RESERVED]
    launched = cfg.engine.rollout_num_engines > 0 and not is_sft(cfg) and not cfg.runtime.debug_train_only
    if not launched:
        # --sglang-dtype still says what external engines compute in (the weights' dtype on the way)
        external = bool(cfg.engine.rollout_external_engine_addrs)
        unused = [key for key in args if key not in SGLANG_RESERVED and not (external and key == "dtype")]
        if unused:
            flags = ", ".join(f"--sglang-{key.replace('_', '-')}" for key in unused)
            where = "every engine is external (--rollout-external-engine-addrs)" if external else "it has no engine"
            e.append(f"{flags}: this run starts no engine ({where}), so nothing reads them; drop them")
    elif cfg.engine.engine == "embedded" and unread:
        flags = ", ".join(f"--sglang-{key.replace('_', '-')}" for key in unread)
        e.append(
            f"{flags}: the embedded engine reads no such SGLang flag (it reads --sglang-disable-cuda-graph, "
            "--sglang-disable-radix-cache, --sglang-quantization fp8 and --sglang-dtype); drop it, or run SGLang "
            "with --engine sglang"
        )
    return e


def check_batching(cfg: MilesConfig) -> list[str]:
    e: list[str] = []
    r, t = cfg.rollout, cfg.train
    dp, gbs = cfg.dp_size, r.global_batch_size
    dp_text = f"data-parallel size {dp} (--actor-num-nodes={t.actor_num_nodes} × --actor-num-gpus-per-node={t.actor_num_gpus_per_node}"
    dp_text += f" / {cfg.model_parallel_size} model-parallel ranks)" if cfg.model_parallel_size > 1 else ")"
    if gbs is not None and gbs < dp:
        e.append(f"--global-batch-size={gbs} is smaller than the {dp_text}; raise it to at least {dp}")
    elif gbs is not None and gbs % dp:
        e.append(f"--global-batch-size={gbs} is not divisible by the {dp_text}; pick a multiple of {dp}")
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        e.append("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one packed micro-batch)")
    osb, rbs = r.over_sampling_batch_size, r.rollout_batch_size
    if osb is not None and rbs is not None and osb < rbs:
        e.append(
            f"--over-sampling-batch-size={osb} is smaller than --rollout-batch-size={rbs}; raise it to at least {rbs}"
        )
    prompt_len, ctx = cfg.data.rollout_max_prompt_len, r.rollout_max_context_len
    if prompt_len is not None and ctx is not None and prompt_len > ctx - 1:
        e.append(
            f"--rollout-max-prompt-len={prompt_len} leaves no room to generate within --rollout-max-context-len={ctx}; "
            f"set it to at most {ctx - 1}"
        )
    if len(cfg.eval.eval_prompt_data) % 2:
        e.append(f"--eval-prompt-data takes name/path pairs, got {len(cfg.eval.eval_prompt_data)} values")
    return e


def check_algo(cfg: MilesConfig) -> list[str]:
    e: list[str] = []
    a = cfg.algo
    if a.advantage_estimator.startswith("reinforce_plus_plus") and not a.normalize_advantages:
        e.append(f"--advantage-estimator={a.advantage_estimator} needs --normalize-advantages")
    if a.use_rollout_logprobs and a.use_tis:
        e.append(
            "--use-rollout-logprobs and --use-tis exclude each other (TIS corrects the rollout log-probs); drop one"
        )
    if a.kl_coef != 0 and a.kl_loss_coef != 0:
        e.append(
            f"--kl-coef={a.kl_coef} (KL in the reward) and --kl-loss-coef={a.kl_loss_coef} (KL loss) are both non-zero; keep one"
        )
    if a.advantage_estimator == "ppo" and a.kl_coef != 0:
        e.append(
            f"--advantage-estimator=ppo does not take --kl-coef={a.kl_coef}; use --use-kl-loss --kl-loss-coef instead"
        )
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        e.append(f"--eps-clip-c={a.eps_clip_c} must be greater than 1 (dual-clip bound), e.g. 3.0")
    if a.calculate_per_token_loss and a.loss_aggregation != "token_mean":
        e.append(f"--calculate-per-token-loss means token_mean, but --loss-aggregation={a.loss_aggregation}; drop one")
    if a.loss_type == "custom_loss" and not a.custom_loss_function_path:
        e.append("--loss-type=custom_loss needs --custom-loss-function-path")
    if cfg.reward.group_rm and not cfg.reward.custom_rm_path:
        e.append("--group-rm scores groups with --custom-rm-path; set --custom-rm-path")
    return e


def parse_teacher_urls(entries: list[str]) -> dict[str, str]:
    """`--opd-teacher-urls NAME=URL ...` as {name: base URL}; a trailing /generate (Miles' form) is dropped."""
    urls: dict[str, str] = {}
    for entry in entries:
        name, sep, url = (part.strip() for part in entry.partition("="))
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"--opd-teacher-urls entry {entry!r} is not NAME=URL with an http(s) URL, "
                "e.g. default=http://127.0.0.1:30000"
            )
        if name in urls:
            raise ValueError(f"--opd-teacher-urls names the teacher {name!r} twice; give each name once")
        urls[name] = url.rstrip("/").removesuffix("/generate")
    return urls


_OPD_FLAGS = (
    "opd_type",
    "opd_kl_coef",
    "opd_log_prob_top_k",
    "opd_top_k_strategy",
    "opd_reward_weight_mode",
    "opd_teacher_urls",
    "opd_teacher_key",
    "opd_teacher_load",
)


def check_opd(cfg: MilesConfig) -> list[str]:
    """On-policy distillation: a teacher, named consistently, with settings that take effect."""
    a = cfg.algo
    if not a.use_opd:
        given = [flag(n) for n in _OPD_FLAGS if cfg.get(n) != FIELDS[n].default]
        return (
            [f"{', '.join(given)}: distillation settings without --use-opd take no effect; add --use-opd or drop them"]
            if given
            else []
        )
    e: list[str] = []
    try:
        urls = parse_teacher_urls(a.opd_teacher_urls)
    except ValueError as exc:
        e.append(str(exc))
        urls = {"?": ""}
    r = cfg.rollout
    if r.rollout_function_path and (urls or a.opd_teacher_load):
        e.append(
            "--opd-teacher-urls / --opd-teacher-load score samples in the built-in rollout, which "
            "--rollout-function-path replaces: fill Sample.teacher_log_probs in the rollout function and drop them"
        )
    elif not r.rollout_function_path and not urls and not a.opd_teacher_load:
        e.append(
            "--use-opd needs a teacher: --opd-teacher-urls default=http://HOST:PORT (a served teacher) or "
            "--opd-teacher-load DIR (a checkpoint this run serves)"
        )
    custom_generate = r.custom_generate_function_path or r.custom_agent_function_path
    if a.opd_log_prob_top_k > 0 and custom_generate and a.opd_top_k_strategy != "only-teacher":
        e.append(
            f"--opd-top-k-strategy {a.opd_top_k_strategy} reads the student's top-K log-probs, which the built-in "
            "generate records and a custom generate or agent function does not; use --opd-top-k-strategy "
            "only-teacher, or sampled-token OPD (--opd-log-prob-top-k 0)"
        )
    if a.opd_teacher_load and DEFAULT_TEACHER in urls:
        e.append(
            "--opd-teacher-load is served as the teacher 'default' and --opd-teacher-urls names a 'default' "
            "too; rename the URL's teacher"
        )
    if a.opd_type == "sglang" and a.opd_teacher_load:
        e.append(
            "--opd-type sglang scores with served teachers (--opd-teacher-urls); --opd-teacher-load is "
            "--opd-type megatron's: drop one"
        )
    if a.opd_type == "megatron" and (urls or not a.opd_teacher_load):
        e.append(
            "--opd-type megatron scores with the --opd-teacher-load checkpoint alone: give it, and drop "
            "--opd-teacher-urls"
        )
    if a.opd_log_prob_top_k < 0:
        e.append(f"--opd-log-prob-top-k={a.opd_log_prob_top_k} must be >= 0 (0: the sampled token alone)")
    if a.opd_log_prob_top_k == 0 and (a.opd_top_k_strategy, a.opd_reward_weight_mode) != ("only-student", "student_p"):
        e.append(
            "--opd-top-k-strategy / --opd-reward-weight-mode shape the top-K estimate; add "
            "--opd-log-prob-top-k K (e.g. 16) or drop them"
        )
    if a.loss_type == "sft_loss":
        e.append("--use-opd shapes the policy-gradient advantage, which --loss-type sft_loss has none of; drop one")
    return e


def check_numbers(cfg: MilesConfig, explicit: set[str]) -> list[str]:
    """Every numeric flag given lies in its stated range (miles.config.ranges; floats are finite, lists are
    checked element by element): `--lr inf` would otherwise train to NaN weights and exit 0. Defaults are
    valid, and derived values (`--critic-lr` from `--lr`) are copies of flags checked here. Then the
    sizes bounded by the machine, and the samples one rollout step holds."""
    errors = []
    for name in sorted(explicit & FIELDS.keys()):
        spec, value = FIELDS[name], cfg.get(name)
        values = value if isinstance(value, list) else [value]
        numeric = spec.base in (int, float) or (spec.base is list and spec.elem in (int, float))
        for v in values if numeric else ():
            if (
                v is None
                or name not in NUMBER_RANGES
                or name in CHECKED_ELSEWHERE
                or in_range(v, NUMBER_RANGES[name][0])
            ):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                default = f" (default {spec.default})" if spec.default not in (None, []) else ""
                errors.append(f"{flag(name)}={v} is not a finite number; give a real value{default}")
                continue
            if name in CHECKED_ELSEWHERE:
                continue
            interval, meaning = NUMBER_RANGES[name]
            errors.append(f"{flag(name)}={v} is outside {interval} ({meaning})")
    errors += machine_errors({n: cfg.get(n) for n in MACHINE_LIMITS if n in explicit}, flag)
    r = cfg.rollout
    if r.rollout_batch_size and r.rollout_batch_size * r.n_samples_per_prompt > MAX_SAMPLES_PER_STEP:
        errors.append(
            f"--rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt {r.n_samples_per_prompt} = "
            f"{r.rollout_batch_size * r.n_samples_per_prompt} samples per rollout step, over the controller's "
            f"{MAX_SAMPLES_PER_STEP}; give fewer"
        )
    return errors


def check_train_inputs(cfg: MilesConfig) -> list[str]:
    """What a training run cannot start without."""
    e: list[str] = []
    if not cfg.model.hf_checkpoint:
        e.append("--hf-checkpoint is required (HF model directory for the engines and the trainer)")
    if not cfg.data.prompt_data and not cfg.data.data_source_path:
        e.append("--prompt-data is required (JSONL of prompts), or --data-source-path for a custom source")
    rw = cfg.reward
    has_reward = rw.rm_type or rw.custom_rm_path or rw.group_reward_path or cfg.rollout.rollout_function_path
    if not has_reward and cfg.algo.loss_type != "sft_loss":
        e.append("no reward: set --rm-type (e.g. math) or --custom-rm-path pkg.module:fn")
    if cfg.rollout.rollout_batch_size is None:
        e.append("--rollout-batch-size is required (prompt groups per rollout step), or --global-batch-size")
    if cfg.rollout.num_rollout is None and cfg.data.num_epoch is None:
        e.append("give --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data)")
    return e


def check_debug_modes(cfg: MilesConfig) -> list[str]:
    """--debug-rollout-only / --debug-train-only and the saved rollouts they write and read (Miles' semantics:
    --load-debug-rollout-data implies --debug-train-only)."""
    rt, e = cfg.runtime, []
    rt.debug_train_only = rt.debug_train_only or bool(rt.load_debug_rollout_data)
    mode = "--debug-train-only" if rt.debug_train_only else "--debug-rollout-only" if rt.debug_rollout_only else None
    if rt.debug_train_only and rt.debug_rollout_only:
        return [
            "--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) together would start "
            "neither engines nor a trainer; pick one"
        ]
    if rt.debug_train_only and not rt.load_debug_rollout_data:
        e.append(
            "--debug-train-only needs --load-debug-rollout-data PATH (files written by "
            "--save-debug-rollout-data); add it"
        )
    if mode and cfg.async_.fully_async:
        e.append(f"{mode} is supported by the sync loop only; drop --fully-async")
    if rt.save_debug_rollout_data and cfg.async_.fully_async:
        e.append("--save-debug-rollout-data is supported by the sync loop only; drop --fully-async")
    for name in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(rt, name)
        if template and not _has_rollout_id(template):
            e.append(
                f"{flag(name)}={template!r} needs '{{rollout_id}}' in the path (one file per step), "
                "and no other {...} field; e.g. rollouts/{rollout_id}.pt"
            )
    if rt.save_debug_rollout_data and rt.save_debug_rollout_data == rt.load_debug_rollout_data:
        e.append("--save-debug-rollout-data is the path --load-debug-rollout-data reads; drop it or pick another")
    if rt.debug_rollout_only and (cfg.train.save or cfg.train.load):
        e.append(
            "--debug-rollout-only starts no trainer, so it neither saves nor loads checkpoints; drop --save and --load"
        )
    if rt.debug_train_only and cfg.eval.eval_interval and cfg.eval.eval_prompt_data:
        e.append("--debug-train-only starts no engine and cannot evaluate; add --eval-interval none")
    if rt.debug_train_only and cfg.engine.rollout_external_engine_addrs:
        e.append("--debug-train-only uses no engine; drop --rollout-external-engine-addrs")
    resumes = cfg.train.load or (cfg.train.auto_resume and cfg.train.save)  # the first step comes from a checkpoint
    if rt.load_debug_rollout_data and _has_rollout_id(rt.load_debug_rollout_data) and not resumes:
        first = cfg.rollout.start_rollout_id or 0
        path = rt.load_debug_rollout_data.format(rollout_id=first)
        if not os.path.isfile(path):
            e.append(
                f"--load-debug-rollout-data: no saved rollout for the first step ({first}) at {path}; "
                "write it with --save-debug-rollout-data first"
            )
    return e


def _has_rollout_id(template: str) -> bool:
    try:
        return template.format(rollout_id=0) != template.format(rollout_id=1)
    except (KeyError, IndexError, ValueError):
        return False


def finalize(cfg: MilesConfig, explicit: set[str], *, for_train: bool = True) -> None:
    """Derive, then validate; raise one ConfigError listing every problem."""
    errors = resolve_batch_knobs(cfg, explicit) + resolve_rollout_engines(cfg, explicit)
    apply_derivations(cfg, explicit)
    errors += check_enums(cfg) + check_modes(cfg) + check_batching(cfg) + check_algo(cfg)
    errors += check_not_implemented(cfg) + check_mode_support(cfg)
    errors += check_sglang_passthrough(cfg) + check_numbers(cfg, explicit)
    errors += check_debug_modes(cfg) + check_lora(cfg) + check_sft(cfg) + check_opd(cfg)
    errors += check_memory_levers(cfg)
    if for_train:
        errors += check_train_inputs(cfg)
    if errors:
        raise ConfigError(errors)
