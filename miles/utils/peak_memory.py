"""Peak GPU memory per phase of a step: `perf/peak_mem_gb/<phase>`.

torch's allocator keeps one running maximum per device; each phase resets it on entry and reads it on
exit, so a phase's figure is the most this process held during that phase (weights, optimizer state
and activations alike), not since the process started. Off CUDA no figure is written. Memory another
process holds on the same GPU (a colocated engine) is not counted here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PREFIX = "perf/peak_mem_gb/"


@contextmanager
def phase_peak(device: torch.device | str, name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Record the peak of allocated memory on `device` during the block as `metrics[PREFIX + name]`."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    torch.cuda.reset_peak_memory_stats(device)
    yield
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    key = PREFIX + name
    metrics[key] = max(metrics.get(key, 0.0), peak)
