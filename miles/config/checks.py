"""Derivations and start-up validation of a parsed `MilesConfig`.

Three passes, in order: the four-knob batch invariant (and the engine count), the values that depend
on other flags (each section's own `derive()`, then the cross-section ones), then every invalid
combination, one rule module per feature under `miles.config.rules`. Problems are collected and
raised together as one ConfigError, each naming the flags involved, the values seen and what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.config.fields import ConfigError
from miles.config.rules import (
    agentic,
    algo,
    batch,
    debug,
    derive,
    engines,
    inputs,
    lora_sft,
    megatron,
    memory,
    modes,
    opd,
    residual,
    routing_replay,
    true_on_policy,
    values,
    wandb,
)

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

# Every rule that reads the config alone, in the order its problems are listed.
RULES: tuple[Callable[[MilesConfig], list[str]], ...] = (
    values.check_enums,
    modes.check_modes,
    batch.check_batching,
    algo.check_algo,
    modes.check_not_implemented,
    modes.check_fully_async_only,
    modes.check_sync_only,
    modes.check_weights_interval,
    agentic.check_agentic,
    true_on_policy.check_true_on_policy,
    routing_replay.check_routing_replay,
    residual.check_fp32_residual,
    residual.check_fp8_forward,
    engines.check_sglang_engine,
    engines.check_embedded_engine,
    megatron.check_parallelism,
    wandb.check_wandb,
    engines.check_sglang_passthrough,
)
# ... then check_numbers (it needs the flags given), then these.
LATE_RULES: tuple[Callable[[MilesConfig], list[str]], ...] = (
    debug.check_debug_modes,
    lora_sft.check_lora,
    lora_sft.check_sft,
    opd.check_opd,
    memory.check_memory_levers,
)


def finalize(cfg: MilesConfig, explicit: set[str], *, for_train: bool = True) -> None:
    """Derive, then validate; raise one ConfigError listing every problem."""
    errors = batch.resolve_batch_knobs(cfg, explicit) + engines.resolve_rollout_engines(cfg, explicit)
    derive.apply_derivations(cfg, explicit)
    for rule in RULES:
        errors += rule(cfg)
    errors += values.check_numbers(cfg, explicit)
    for rule in LATE_RULES:
        errors += rule(cfg)
    if for_train:
        errors += inputs.check_train_inputs(cfg)
    if errors:
        raise ConfigError(errors)
