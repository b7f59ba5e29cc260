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


class StartupClock:
    """Where a run's start-up goes: seconds per phase, and from the process's launch to the first step.

    `mark(name)` closes the phase that ran since the previous mark; `finish()` returns them as
    `perf/startup/<name>` plus `perf/startup_time` (launch of this process to now), once.
    """

    def __init__(self) -> None:
        import psutil

        self._launched = psutil.Process().create_time()  # wall clock: imports before this object count too
        self._last = time.perf_counter()
        self._phases: dict[str, float] = {"before_run": time.time() - self._launched}
        self.done = False

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = self._phases.get(name, 0.0) + now - self._last
        self._last = now

    def finish(self) -> dict[str, float]:
        self.done = True
        out = {f"perf/startup/{k}": v for k, v in self._phases.items()}
        out["perf/startup_time"] = time.time() - self._launched
        return out
