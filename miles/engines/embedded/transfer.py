"""Host lists onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory, and torch then synchronizes the stream:
the host waits until every kernel queued before it has run. In an engine step that queues its work ahead
of the GPU (the scheduler's lookahead), one such copy turns the overlap into a stall. `to_device` stages
the values in pinned memory and copies them asynchronously; torch's pinned allocator keeps the staging
block until the copy has run, so the values may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `dtype` on `device` holding `values` (a list, nested lists or a tensor); on CUDA the
    copy is queued behind the stream's work, not waited for. Through numpy a list converts ~4x faster than
    through torch.tensor, which counts in a CPU decode step."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    if host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


_NUMPY = {
    torch.long: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}
