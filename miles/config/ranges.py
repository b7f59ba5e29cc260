"""The range of every numeric flag, checked at start-up and listed in docs/config.md.

Each int and float field (and each list of numbers, element by element) states its range and what
the number counts beside its type (`option(range=..., unit=...)`, see miles.config.option);
`NUMBER_RANGES` collects them. Every float must also be finite. A numeric field without a range
fails tests/unit's coverage test.

`MACHINE_LIMITS`: sizes bounded by the machine the controller runs on (host memory), refused with
the limit when they cannot fit. Counts the controller materialises in memory every step (samples
of a rollout step) have a fixed ceiling, `MAX_SAMPLES_PER_STEP`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from miles.config.fields import FIELDS
from miles.config.option import MAX_GROUP_SIZE, MAX_SAMPLES_PER_STEP

__all__ = ["MAX_GROUP_SIZE", "MAX_SAMPLES_PER_STEP"]

# field -> (range, what it means)
NUMBER_RANGES: dict[str, tuple[str, str]] = {
    name: (spec.range, spec.unit or "") for name, spec in FIELDS.items() if spec.range is not None
}


# ranges stated here but checked, with a fuller message, where the value is used
CHECKED_ELSEWHERE = frozenset({"eps_clip_c", "num_nodes"})  # check_algo; placement (resolve_machine)


def in_range(value: float, spec: str) -> bool:
    """Whether `value` lies in `spec` ("[a, b)" intervals and single values joined by " or ")."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    for part in spec.split(" or "):
        part = part.strip()
        if part[0] in "[(":
            low, high = (float(x) for x in part[1:-1].split(","))
            above = value > low if part[0] == "(" else value >= low
            below = value < high if part[-1] == ")" else value <= high
            if above and below:
                return True
        elif value == float(part):
            return True
    return False


def _host_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


# field -> (its value in bytes, given the field's value) for the sizes bounded by host memory
MACHINE_LIMITS: dict[str, Callable[[float], float]] = {
    "update_weight_buffer_size": lambda v: v,  # the trainer stages one bucket in host memory
    "http_max_body_mb": lambda v: v * 2**20,  # a request body is held whole before parsing
}


def machine_errors(values: dict[str, float | None], flag: Callable[[str], str]) -> list[str]:
    """One line per size in `values` that cannot fit this host's memory, naming the limit."""
    total = _host_memory_bytes()
    errors = []
    for name, to_bytes in MACHINE_LIMITS.items():
        value = values.get(name)
        if value is not None and to_bytes(value) > total:
            errors.append(
                f"{flag(name)}={value:g} needs {to_bytes(value) / 2**30:.1f} GiB, more than this host's "
                f"{total / 2**30:.1f} GiB of memory; give a smaller size"
            )
    return errors


def ranged(kind: type, spec: str) -> Callable[[str], float]:
    """An argparse `type` for the serving commands' numeric flags: `kind` within `spec`, else a usage error."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not in_range(value, spec):
            raise argparse.ArgumentTypeError(f"{text} is outside {spec}")
        return value

    return parse
