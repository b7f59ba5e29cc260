"""Phase timers: `with timers("rollout/generate"): ...` accumulates seconds per name for one step."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class StepTimers:
    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] += seconds

    def get(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def pop_all(self, prefix: str = "perf/") -> dict[str, float]:
        out = {f"{prefix}{k}": v for k, v in self._seconds.items()}
        self._seconds.clear()
        return out
