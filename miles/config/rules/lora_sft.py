"""Start-up checks of the two training variants that change what the trainer optimises.

LoRA (`--lora-rank` > 0): only an adapter of the policy is trained and pushed to the engines. It
needs peft, the FSDP trainer, the embedded engine (which merges the adapter into its resident base)
and a transport that carries adapters (broadcast, or the colocated handoff).

SFT (`--loss-type sft_loss`): supervised fine-tuning on prompt/response rows (or chat messages).
No engine is started and nothing is generated or scored, so every flag that only shapes
generation, rewards, RL objectives or weight pushes would be silently ignored: such flags are
refused here by name, each with what to do instead.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from miles.config.fields import FIELDS
from miles.config.rules.derive import fp8_serving

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

LORA_FLAGS = ("lora_alpha", "lora_dropout", "lora_merged_forward", "target_modules")

# Flags an SFT run would ignore, refused when they differ from their default.
SFT_UNUSED: dict[str, str] = {
    **dict.fromkeys(
        ("rm_type", "rm_url", "reward_key", "custom_rm_path", "group_rm", "group_reward_path"),
        "SFT trains on the responses in --prompt-data and scores nothing",
    ),
    **dict.fromkeys(
        (
            "rollout_top_p",
            "rollout_top_k",
            "rollout_min_p",
            "rollout_stop",
            "rollout_stop_token_ids",
            "rollout_max_response_len",
            "dynamic_sampling_filter_path",
            "rollout_sample_filter_path",
            "partial_rollout",
            "recompute_logprobs_via_prefill",
            "use_session_server",
            "reward_phase",
            "rollout_function_path",
            "custom_generate_function_path",
            "custom_agent_function_path",
        ),
        "SFT generates nothing",
    ),
    "rollout_temperature": "SFT fits the model's own distribution (temperature 1); the trainer would divide "
    "the logits by this",
    **dict.fromkeys(
        (
            "advantage_estimator",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_coef",
            "entropy_coef",
            "normalize_advantages",
            "use_rollout_logprobs",
            "use_tis",
            "eps_clip_c",
            "use_opd",
        ),
        "the SFT loss is the negative log-likelihood of the response tokens, with no advantages, KL or "
        "importance weights",
    ),
    **dict.fromkeys(
        (
            "engine",
            "rollout_num_engines",
            "rollout_num_gpus",
            "colocate",
            "rollout_external_engine_addrs",
            "update_weight_transfer_mode",
            "check_weight_update_equal",
            "update_weights_interval",
            "fully_async",
        ),
        "SFT starts no rollout engine and pushes no weights",
    ),
    **dict.fromkeys(
        (
            "debug_rollout_only",
            "debug_train_only",
            "load_debug_rollout_data",
            "save_debug_rollout_data",
            "dump_details",
        ),
        "SFT reads its samples from --prompt-data",
    ),
}


def is_sft(cfg: MilesConfig) -> bool:
    """Supervised fine-tuning: the trainer alone, on --prompt-data's responses."""
    return cfg.algo.loss_type == "sft_loss"


def _set(cfg: MilesConfig, name: str) -> bool:
    return name in FIELDS and cfg.get(name) != FIELDS[name].default


def check_lora(cfg: MilesConfig) -> list[str]:
    """--lora-rank and its companions; the modes LoRA cannot run in."""
    t, e = cfg.train, []
    if t.lora_rank < 0:
        return [f"--lora-rank={t.lora_rank} must be >= 0 (0 trains every parameter)"]
    if t.lora_rank == 0:
        stray = [FIELDS[n].flag for n in LORA_FLAGS if _set(cfg, n)]
        if stray:
            e.append(
                f"{', '.join(stray)} without --lora-rank does nothing (full fine-tuning); "
                "add --lora-rank R (e.g. 8) or drop them"
            )
        return e
    if t.lora_alpha <= 0:
        e.append(f"--lora-alpha={t.lora_alpha} must be positive (the adapter is scaled by alpha / rank)")
    if not 0.0 <= t.lora_dropout < 1.0:
        e.append(f"--lora-dropout={t.lora_dropout} must lie in [0, 1)")
    elif t.lora_merged_forward and t.lora_dropout > 0:
        e.append(
            f"--lora-merged-forward with --lora-dropout {t.lora_dropout}: the merged weight sees the adapter's input "
            "undropped, as the engine does; drop one"
        )
    if t.target_modules is not None and not [m for m in t.target_modules.split(",") if m.strip()]:
        e.append(f"--target-modules={t.target_modules!r} names no module; use all-linear or e.g. q_proj,v_proj")
    if cfg.train.train_backend != "fsdp":
        e.append(
            f"--lora-rank with --train-backend {cfg.train.train_backend}: LoRA is implemented for the FSDP backend "
            "only; use --train-backend fsdp"
        )
    if importlib.util.find_spec("peft") is None:
        e.append("--lora-rank needs peft, which is not installed: pip install 'miles[lora]'")
    if cfg.weights.update_weight_transfer_mode == "p2p":
        e.append("--update-weight-transfer-mode=p2p does not carry LoRA adapters; use broadcast (the default)")
    if cfg.engine.engine != "embedded":
        e.append(
            f"--lora-rank with --engine {cfg.engine.engine}: only the embedded engine applies the pushed "
            "adapter to every request (SGLang serves an adapter only to requests that name it); "
            "use --engine embedded"
        )
    elif fp8 := fp8_serving(cfg):
        e.append(
            f"{fp8} with --lora-rank: the embedded engine merges adapters into bf16 weights; serve bf16 (drop "
            "the quantization) or train without LoRA"
        )
    if cfg.weights.check_weight_update_equal:
        e.append(
            "--check-weight-update-equal compares full weights; with --lora-rank only the adapter moves, "
            "so drop --check-weight-update-equal"
        )
    if cfg.algo.advantage_estimator == "ppo":
        e.append(
            "--advantage-estimator=ppo with --lora-rank: the critic would be trained in full beside an "
            "adapter policy, a combination not supported; use grpo, gspo or reinforce_plus_plus"
        )
    return e


def check_sft(cfg: MilesConfig) -> list[str]:
    """--loss-type sft_loss: the flags an SFT run would ignore, and its batch shape."""
    if not is_sft(cfg):
        return []
    e = [
        f"{FIELDS[n].flag}={cfg.get(n)!r} with --loss-type sft_loss: {why}; drop it"
        for n, why in SFT_UNUSED.items()
        if _set(cfg, n) and not (n == "save_debug_rollout_data" and cfg.runtime.dump_details)  # named once, as given
    ]
    if cfg.rollout.n_samples_per_prompt != 1:
        e.append(
            f"--n-samples-per-prompt={cfg.rollout.n_samples_per_prompt} with --loss-type sft_loss: each "
            "row is one training sample; drop it (1)"
        )
    if cfg.eval.eval_interval is not None and cfg.eval.eval_prompt_data:
        e.append(
            "--eval-interval with --loss-type sft_loss: SFT starts no engine to evaluate with; drop "
            "--eval-interval (evaluate the exported checkpoint in an RL run instead)"
        )
    if cfg.data.data_source_path:
        e.append(
            "--data-source-path with --loss-type sft_loss: SFT reads prompt/response rows from "
            "--prompt-data; drop --data-source-path"
        )
    return e
