"""Colocated offload: whether the trainer and the engines move out of the GPU's way, decided once.

On a colocated run the engines and the trainer share the GPUs. While the engines generate, the
trainer's state may be offloaded (`--offload-train`); while the trainer trains, the engines may
release their memory (`--offload-rollout`, the tags of `--offload-rollout-level`). Left at their
defaults both are off when every trainer rank fits beside its engine (`resolve_offload`).
`OffloadPlan` is the decision the run acts on; apart, nothing moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from miles.config import MilesConfig, engine_memory_tags
from miles.controller.trainers import TrainerGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """`trainer`: offload the trainer while the engines generate; `engine_tags`: the engine memory
    released while the trainer trains (empty: none)."""

    trainer: bool = False
    engine_tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: MilesConfig, *, colocated: bool, has_trainer: bool, has_engines: bool) -> OffloadPlan:
        if not colocated:
            return cls()
        t = cfg.train
        tags = tuple(engine_memory_tags(t.offload_rollout_level)) if t.offload_rollout and has_engines else ()
        return cls(trainer=bool(t.offload_train) and has_trainer, engine_tags=tags)


async def resolve_offload(cfg: MilesConfig, trainers: TrainerGroup, device: str) -> None:
    """Colocated offload left at its default, for trainers on `device` (the plan's "cuda" or "cpu"): off when
    every trainer rank fits beside its engine.

    On CPU it is off: "offloading" there copies host memory to host memory and frees nothing (a 0.5B
    model's trainer moved 7 GB back and forth around every step). On GPUs, when a trainer cannot tell,
    offload stays on (the safe choice). Flags the user set are kept as they are.
    """
    t = cfg.train
    if t.offload_train is not None and t.offload_rollout is not None:
        return
    if device != "cuda":
        logger.info("colocated on %s: offload off (there is no device memory to free)", device)
        t.offload_train = bool(t.offload_train)
        t.offload_rollout = bool(t.offload_rollout)
        return
    plans = await trainers.memory_plan()
    fits = all(p is not None and p["fits"] for p in plans)
    chosen = {"offload_train": t.offload_train, "offload_rollout": t.offload_rollout}  # None: decided here
    if t.offload_train is None:
        t.offload_train = not fits
    if t.offload_rollout is None:
        t.offload_rollout = not fits
    if plans[0] is not None:
        p = min(plans, key=lambda x: x["free_bytes"] - x["pending_state_bytes"] - x["activation_bytes"])
        logger.info(
            "colocated memory: %.1f of %.1f GiB free with the engines loaded; the trainer still needs %.1f GiB of "
            "state and up to %.1f GiB of activations (%s): %s",
            p["free_bytes"] / 2**30,
            p["total_bytes"] / 2**30,
            p["pending_state_bytes"] / 2**30,
            p["activation_bytes"] / 2**30,
            "both fit" if fits else "they do not both fit",
            ", ".join(
                f"--{k.replace('_', '-')} {'on' if getattr(t, k) else 'off'}{'' if v is None else ' (as set)'}"
                for k, v in chosen.items()
            ),
        )
    if t.offload_train and t.offload_rollout:
        _warn_if_offload_is_not_enough(plans)


def tokens_that_fit_offloaded(p: dict) -> int | None:
    """With offload on, the engines give their memory back while the trainer trains, which then has about the
    whole GPU less the headroom, what the trainer holds already and its pending state (a rank's `memory_plan`).
    None when a micro-batch at the token budget fits in that, or the plan cannot tell; else the budget that
    would, in whole 1,024 tokens."""
    tokens, acts = int(p.get("tokens") or 0), int(p.get("activation_bytes") or 0)
    if tokens <= 0 or acts <= 0:
        return None
    room = p["total_bytes"] - p.get("headroom_bytes", 0) - p.get("resident_bytes", 0) - p["pending_state_bytes"]
    if acts <= room:
        return None
    return max(0, int(room / (acts / tokens)) // 1024 * 1024)


def _warn_if_offload_is_not_enough(plans: list[dict | None]) -> None:
    """Offload frees the engines' memory, not the trainer's activations: say so at start-up when a micro-batch
    at the token budget is estimated not to fit even then, with the budget that would (the estimate is an
    upper one, so the run goes on)."""
    fit = [n for n in (tokens_that_fit_offloaded(p) for p in plans if p is not None) if n is not None]
    if not fit:
        return
    p = next(p for p in plans if p is not None)
    if min(fit) == 0:
        logger.warning(
            "colocated memory: even with offload the trainer's state leaves no room for a micro-batch's activations "
            "(%.1f GiB of state pending on a %.1f GiB GPU); turn on --gradient-checkpointing, or train on more GPUs",
            p["pending_state_bytes"] / 2**30,
            p["total_bytes"] / 2**30,
        )
    else:
        logger.warning(
            "colocated memory: even with offload a micro-batch of %d tokens is estimated to need more than the GPU "
            "has beside the trainer's state; if it runs out of memory, use --max-tokens-per-gpu %d (or "
            "--gradient-checkpointing)",
            p["tokens"],
            min(fit),
        )
