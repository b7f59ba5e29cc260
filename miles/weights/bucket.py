"""The weight stream: (HF name, tensor) pairs grouped into buckets of about `bucket_bytes`.

The trainer's `named_hf_tensors(dtype)` yields full tensors under HF names (FSDP gathers each
parameter; the cast to the engine dtype happens there). Buckets let a transport call the
engines once per ~512 MB instead of once per tensor, and `pipelined` prepares bucket k+1 while
bucket k is still in flight, so gather and transfer overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from miles.weights.groups import dtype_name

logger = logging.getLogger(__name__)

NamedTensor = tuple[str, torch.Tensor]
DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(slots=True)
class BucketMeta:
    """What an engine needs to allocate a bucket's receive buffers before the bytes arrive."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @property
    def nbytes(self) -> int:
        from miles.weights.groups import dtype_from_name

        total = 0
        for dt, shape in zip(self.dtypes, self.shapes, strict=True):
            numel = 1
            for s in shape:
                numel *= s
            total += numel * dtype_from_name(dt).itemsize
        return total


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_meta(bucket: list[NamedTensor]) -> BucketMeta:
    return BucketMeta(
        names=[n for n, _ in bucket],
        dtypes=[dtype_name(t.dtype) for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
    )


def iter_buckets(
    named: Iterable[NamedTensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[NamedTensor]]:
    """Group tensors in stream order; a bucket is flushed once adding the next tensor would pass `bucket_bytes`.

    A single tensor larger than `bucket_bytes` travels alone in its own bucket. Names must be
    unique across the stream (a duplicate would silently overwrite an engine tensor).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive (--update-weight-buffer-size)")
    seen: set[str] = set()
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight stream; each HF name must be sent once")
        seen.add(name)
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor if tensor.is_contiguous() else tensor.contiguous()))
        size += nbytes
    if bucket:
        yield bucket


def pipelined(buckets: Iterable[list[NamedTensor]], start: Callable[[list[NamedTensor]], Callable[[], None]]) -> int:
    """Send every bucket through `start(bucket)`, which launches its transfer and returns a `finish()` to wait on.

    While bucket k is in flight the next bucket is pulled from the stream (gathers, casts), and
    only then is bucket k finished; bucket k+1 is launched after that, so at most one transfer is
    in flight and engines see buckets in order. Returns the number of buckets sent.
    """
    it = iter(buckets)
    current = next(it, None)
    count = 0
    while current is not None:
        finish = start(current)
        try:
            upcoming = next(it, None)
        finally:
            # Even when preparing the next bucket fails, the one in flight is waited for first.
            finish()
        count += 1
        current = upcoming
    return count
