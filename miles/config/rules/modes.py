"""Flags that work in some loop modes only (sync or fully async, colocated or not, pause and transfer modes),
refused at start-up by name in the others; and `NOT_IMPLEMENTED`, the flags refused whenever they differ
from their default.

A launch script ported from Miles must never have a flag silently change meaning. Every flag
either works as in Miles or is refused by a module of this package, before any worker starts, with the
flag, the mode and what to use instead. tests/unit/test_flags_read.py walks every config field and fails
when one is read nowhere outside the config code and is not listed in `NOT_IMPLEMENTED`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.fields import FIELDS

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

# field -> (why it is refused, what to use instead); refused whenever its value is not the default.
NOT_IMPLEMENTED: dict[str, tuple[str, str]] = {}


def check_not_implemented(cfg: MilesConfig) -> list[str]:
    errors = []
    for name, (why, instead) in NOT_IMPLEMENTED.items():
        value = cfg.get(name)
        if value != FIELDS[name].default:
            errors.append(f"{FIELDS[name].flag}={value!r} is not supported: {why}; {instead}")
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


def check_fully_async_only(cfg: MilesConfig) -> list[str]:
    """Flags the sync loop would ignore."""
    e, ev = [], cfg.eval
    if ev.eval_mode != "shared" and not cfg.async_.fully_async:
        e.append(
            f"--eval-mode={ev.eval_mode} works only with --fully-async; the sync loop evaluates on the rollout "
            "engines between steps: drop --eval-mode, or add --fully-async"
        )
    if ev.eval_num_engines > 0 and not (cfg.async_.fully_async and ev.eval_mode == "dedicated"):
        e.append(
            f"--eval-num-engines={ev.eval_num_engines} starts engines only with --fully-async --eval-mode dedicated; "
            "drop --eval-num-engines, or add those two"
        )
    return e


def check_sync_only(cfg: MilesConfig) -> list[str]:
    """Flags the fully async loop would ignore."""
    if not cfg.async_.fully_async:
        return []
    e, r = [], cfg.rollout
    if r.recompute_logprobs_via_prefill:
        e.append(
            "--recompute-logprobs-via-prefill is not supported with --fully-async (Miles refuses it too); "
            "drop it, or use --use-tis to correct the rollout log-probs"
        )
    if r.reward_phase != "inline":
        e.append(
            f"--reward-phase={r.reward_phase} does not apply to --fully-async, which scores each sample as it "
            "finishes; use --reward-phase inline, or drop --fully-async"
        )
    if r.rollout_sample_filter_path:
        e.append(
            "--rollout-sample-filter-path runs only in the sync loop; with --fully-async filter whole groups "
            "with --dynamic-sampling-filter-path, or drop --fully-async"
        )
    if cfg.weights.update_weights_interval != 1:
        e.append(
            f"--update-weights-interval={cfg.weights.update_weights_interval} is for the sync loop; "
            "--fully-async pushes after every train step: bound staleness with --max-weight-staleness"
        )
    return e


def check_weights_interval(cfg: MilesConfig) -> list[str]:
    n, t = cfg.weights.update_weights_interval, cfg.train
    if n < 1:
        return [f"--update-weights-interval={n} must be at least 1 (push weights every N rollout steps)"]
    if (
        n > 1
        and cfg.engine.colocate
        and t.offload_rollout is not False
        and {"weight", "weights"} & set(t.offload_rollout_level)
    ):
        return [
            f"--update-weights-interval={n} with --colocate: the engines release their weights while the trainer "
            "trains and need a push every step; use --offload-rollout-level kv_cache, or --update-weights-interval 1"
        ]
    return []
