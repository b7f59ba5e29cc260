"""What --true-on-policy-mode cannot make bit-exact."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.rules.derive import fp8_serving
from miles.config.sections import ENGINE_DTYPES

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_true_on_policy(cfg: MilesConfig) -> list[str]:
    """What --true-on-policy-mode cannot make bit-exact (the model itself is checked once its config is read)."""
    if not cfg.train.true_on_policy_mode:
        return []
    e, why = [], "--true-on-policy-mode"
    if cfg.engine.engine != "embedded" or cfg.engine.rollout_external_engine_addrs:
        e.append(
            f"{why} needs the embedded engine, whose re-scoring runs the trainer's reference forward; the "
            "kernels of an SGLang or external engine are not under this run's control: drop --engine sglang / "
            "--rollout-external-engine-addrs, or drop the mode"
        )
    if cfg.rollout.rollout_function_path:
        e.append(
            f"{why} re-scores every sample in the built-in rollout, which --rollout-function-path replaces; "
            "plug in at --custom-generate-function-path instead, or drop the mode"
        )
    if cfg.async_.fully_async:
        e.append(f"{why} re-scores each sample by prefill, which the sync loop does (as Miles); drop --fully-async")
    if cfg.algo.loss_type == "sft_loss":
        e.append(f"{why} aligns the rollout's log-probs with the trainer's; SFT has no rollout: drop the mode")
    if cfg.train.train_backend != "fsdp":
        e.append(f"{why} is implemented by the FSDP backend's trainer; use --train-backend fsdp")
    given = cfg.engine.sglang_args.get("dtype")
    if given is not None and ENGINE_DTYPES.get(str(given)) != cfg.model.dtype:
        e.append(
            f"{why} runs the engine in the trainer's --dtype={cfg.model.dtype}; drop --sglang-dtype={given} "
            "(or give --dtype the same value)"
        )
    if cfg.train.lora_rank and not cfg.train.lora_merged_forward:
        e.append(
            f"{why} with --lora-rank: the engine merges the adapter into its weights while the trainer adds it "
            "as a separate low-rank path, which round differently; add --lora-merged-forward (the trainer then "
            "computes with the merged weight) or drop one"
        )
    if cfg.train.compile:
        e.append(f"{why} runs the engine's eager reference forward on the trainer too; drop --compile")
    fp8 = fp8_serving(cfg)
    if fp8:
        e.append(f"{fp8} with {why}: the mode scores with the trainer's exact weights; drop one")
    kv_dtype = cfg.engine.sglang_args.get("kv_cache_dtype")
    if kv_dtype not in (None, "auto"):
        e.append(
            f"--sglang-kv-cache-dtype={kv_dtype} with {why}: the engine would sample attending over keys and "
            "values rounded to FP8, the trainer scores with exact ones; drop one (or use auto)"
        )
    if cfg.train.attn_implementation != "auto":
        e.append(
            f"{why} scores with the reference forward's eager attention; drop "
            f"--attn-implementation {cfg.train.attn_implementation}"
        )
    if cfg.train.use_dynamic_batch_size and cfg.dp_size > 1:
        e.append(
            f"{why} forwards one sequence at a time and every rank must run as many forwards: with "
            f"{cfg.dp_size} trainer ranks use fixed --micro-batch-size instead of --use-dynamic-batch-size"
        )
    return e
