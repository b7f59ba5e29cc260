"""Rollout engines: how many (--rollout-num-gpus), the --sglang-* passthrough, and what a launched SGLang
server or the embedded engine cannot do, refused before any worker starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.fields import FIELDS
from miles.config.rules.lora_sft import is_sft
from miles.config.sections import EMBEDDED_KV_CACHE_DTYPES, ENGINE_DTYPES

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


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
EMBEDDED_SGLANG_ARGS = ("disable_cuda_graph", "disable_radix_cache", "dtype", "kv_cache_dtype", "quantization")


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
    kv_dtype = args.get("kv_cache_dtype")
    if cfg.engine.engine == "embedded" and kv_dtype is not None and str(kv_dtype) not in EMBEDDED_KV_CACHE_DTYPES:
        e.append(
            f"--sglang-kv-cache-dtype={kv_dtype!r}: the embedded engine stores its KV cache as "
            f"{', '.join(EMBEDDED_KV_CACHE_DTYPES)}; use one of them or --engine sglang"
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
            "--sglang-disable-radix-cache, --sglang-quantization fp8, --sglang-kv-cache-dtype and --sglang-dtype); "
            "drop it, or run SGLang with --engine sglang"
        )
    return e


# Miles flags a launched SGLang server reads under its own name (`placement.sglang_launch_args`).
SGLANG_NAMES = {"max_running_requests": "--max-running-requests", "max_total_tokens": "--max-total-tokens"}


def check_sglang_engine(cfg: MilesConfig) -> list[str]:
    """What a launched (vanilla) SGLang server cannot do, refused before any worker starts; engines given by
    --rollout-external-engine-addrs are probed for the endpoints when the weight path connects."""
    eng = cfg.engine
    if eng.engine != "sglang" or eng.rollout_num_engines == 0:
        return []
    e = [
        f"{flag} and --sglang-{key.replace('_', '-')} both set SGLang's --{key.replace('_', '-')}; give it once"
        for key, flag in SGLANG_NAMES.items()
        if getattr(eng, key) is not None and key in eng.sglang_args
    ]
    default_body_mb = FIELDS["http_max_body_mb"].default
    if eng.http_max_body_mb != default_body_mb:
        e.append(
            f"--http-max-body-mb={eng.http_max_body_mb} limits the embedded engine's request bodies; SGLang has no "
            "such limit: drop it with --engine sglang"
        )
    if cfg.weights.update_weight_transfer_mode == "disk-delta":
        e.append(
            "--update-weight-transfer-mode=disk-delta patches each engine host's copy through /pull_weights, which "
            "vanilla SGLang does not serve (the embedded engine and Miles' SGLang fork do); with --engine sglang "
            "use broadcast or p2p"
        )
    if cfg.weights.check_weight_update_equal:
        e.append(
            "--check-weight-update-equal needs the digest weight checker (/weights_checker with fill_noise), "
            "which the embedded engine serves and SGLang does not; drop it with --engine sglang, or use "
            "--engine embedded"
        )
    return e


def check_embedded_engine(cfg: MilesConfig) -> list[str]:
    """The embedded engine runs on one device."""
    eng = cfg.engine
    if eng.engine == "embedded" and eng.rollout_num_gpus_per_engine > 1:
        return [
            f"--rollout-num-gpus-per-engine={eng.rollout_num_gpus_per_engine} with --engine embedded: the embedded "
            f"engine runs on one device and would reserve {eng.rollout_num_gpus_per_engine - 1} GPU(s) it never "
            "uses; use --engine sglang for tensor-parallel engines, or set it to 1"
        ]
    return []
