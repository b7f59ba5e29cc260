"""Each value on its own: a Literal field holds one of its choices, a number lies in its range, a size fits
the machine."""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING

from miles.config.fields import FIELDS, flag
from miles.config.option import MAX_SAMPLES_PER_STEP
from miles.config.ranges import CHECKED_ELSEWHERE, MACHINE_LIMITS, NUMBER_RANGES, in_range, machine_errors
from miles.config.rules.batch import KNOBS

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

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
                or (name in KNOBS and v <= 0)  # one line already, from the batch rule
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


# Literal field -> its choices (the one place they are written is the field's type)
ENUM_CHOICES: dict[str, tuple[str, ...]] = {name: spec.choices for name, spec in FIELDS.items() if spec.choices}
