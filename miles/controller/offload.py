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
    if plans[0] is not None:
        p = min(plans, key=lambda x: x["free_bytes"] - x["pending_state_bytes"] - x["activation_bytes"])
        logger.info(
            "colocated memory: %.1f of %.1f GiB free with the engines loaded; the trainer still needs %.1f GiB of "
            "state and up to %.1f GiB of activations: offload %s",
            p["free_bytes"] / 2**30,
            p["total_bytes"] / 2**30,
            p["pending_state_bytes"] / 2**30,
            p["activation_bytes"] / 2**30,
            "off (both fit)" if fits else "on",
        )
    if t.offload_train is None:
        t.offload_train = not fits
    if t.offload_rollout is None:
        t.offload_rollout = not fits
