"""--debug-rollout-only / --debug-train-only and the saved rollouts they write and read."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from miles.config.fields import flag

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


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
        given = "--dump-details" if rt.dump_details else "--save-debug-rollout-data"
        e.append(f"{given} is supported by the sync loop only; drop --fully-async")
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
