"""The trainer computing as the engine does: --fp32-residual-connection and --fp8-format, where they cannot."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_fp32_residual(cfg: MilesConfig) -> list[str]:
    """The FSDP trainer keeps an fp32 stream by hooks on a transformers decoder; the true-on-policy mode scores
    both sides with one reference forward, which these hooks would leave on the trainer's side only."""
    if cfg.train.fp32_residual_connection and cfg.train.true_on_policy_mode:
        return [
            "--fp32-residual-connection with --true-on-policy-mode: the mode scores the engine's samples and the "
            "trainer's with one reference forward, whose stream must be the same on both sides; drop one"
        ]
    return []


def check_fp8_forward(cfg: MilesConfig) -> list[str]:
    """--fp8-format quantizes the FSDP trainer's forward as an FP8 rollout does: only beside FP8 rollouts."""
    from miles.config.rules.derive import fp8_serving

    t = cfg.train
    if t.fp8_format is None:
        return []
    why, e = f"--fp8-format {t.fp8_format}", []
    if fp8_serving(cfg) is None:
        e.append(
            f"{why} quantizes the trainer's forward as FP8 rollouts do, but the engines serve the model's dtype: "
            "a trainer and a rollout that quantize differently drift apart; add --sglang-quantization fp8 (or "
            "serve an FP8 checkpoint), or drop --fp8-format"
        )
    for flag, on in (
        ("--train-backend megatron", t.train_backend == "megatron"),
        ("--true-on-policy-mode", t.true_on_policy_mode),
        ("--lora-rank > 0", t.lora_rank > 0),
    ):
        if on:
            e.append(f"{why} with {flag}: the FP8 forward is the FSDP trainer's full-weight projections'; drop one")
    return e
