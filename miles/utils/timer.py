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


def process_launched() -> float:
    """Wall-clock time this process started (imports before any clock object count too)."""
    import psutil

    return psutil.Process().create_time()


def seconds_since_launch() -> float:
    return time.time() - process_launched()


class PhaseClock:
    """Seconds per phase: `mark(name)` closes the phase that ran since the previous mark (or creation)."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self._phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = self._phases.get(name, 0.0) + now - self._last
        self._last = now

    def summary(self) -> str:
        """E.g. "2.1 s (tokenizer 0.3 s, weights 1.8 s)": the time since creation, then each phase."""
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self._phases.items())
        return f"{time.perf_counter() - self._start:.1f} s ({parts})"


class StartupClock(PhaseClock):
    """Where a run's start-up goes: seconds per phase, and from the process's launch to the first step.

    `mark(name)` closes the phase that ran since the previous mark; `finish()` returns them as
    `perf/startup/<name>` plus `perf/startup_time` (launch of this process to now), once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._launched = process_launched()
        self._phases["before_run"] = time.time() - self._launched
        self.done = False

    def finish(self) -> dict[str, float]:
        self.done = True
        out = {f"perf/startup/{k}": v for k, v in self._phases.items()}
        out["perf/startup_time"] = time.time() - self._launched
        return out
