"""The trainer's side of direct colocated updates: map an engine's exported weight buffer and write into it.

`MappedBuffer` opens one generation of the buffer (the shared-memory segment as a file under
/dev/shm, or the CUDA allocation from its IPC handle) and reads the engine's published generation;
`BufferWriter` copies (HF name, tensor) pairs into the engine's views of it, device to device,
cast to the engine dtype, no staging buffer; an FP8 engine's quantized names are quantized on the device
first, per 128x128 block as the engine's own push does, and written as values and scales. The protocol as a
whole: miles/weights/colocated_direct.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from miles.weights.arena import FP8_BLOCK128, StaleWeightBufferError
from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.groups import dtype_from_name
from miles.weights.tensor_ipc import open_cuda_buffer, shm_path


def _fp8_block128(t: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    from miles.engines.embedded.fp8 import quantize_weight  # what the engine itself runs on a weight push

    quantize_weight(t, out=out)


# How the trainer turns a tensor into what an engine stores for a quantized name (export["quantized"]["format"]):
# quantize(tensor, out=(the view of `name`, the view of `name + "_scale_inv"`)), written in place.
QUANTIZERS = {FP8_BLOCK128: _fp8_block128}

# per HF name: (view, shape, dtype, device, bytes, whether it gets a copy_ of its own)
_Slot = tuple[torch.Tensor, torch.Size, torch.dtype, torch.device, int, bool]


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


class BufferWriter:
    """Writes (HF name, tensor) pairs into a mapped engine weight buffer through cached per-name views."""

    # Same-dtype tensors go out in `_foreach_copy_` batches of BATCH_TENSORS (a few launches per batch,
    # issued as each batch fills, so the GPU starts early). Tensors of LARGE_COPY_BYTES or more get a
    # copy_ (a memcpy) of their own when it is set: faster on the GPU, but ~10 us of host time each,
    # which on the H200 hosts measured left the host issuing copies longer than the GPU took.
    BATCH_TENSORS = 64
    LARGE_COPY_BYTES: int | None = None

    def __init__(self, flat: torch.Tensor, export: dict) -> None:
        self.flat = flat
        self.entries: dict[str, dict] = export["tensors"]
        self.aliases: dict[str, str] = export.get("aliases", {})
        quantized = export.get("quantized") or {}
        if quantized and quantized.get("format") not in QUANTIZERS:
            raise ValueError(
                f"the engine stores weights as {quantized.get('format')!r}, which this trainer cannot write "
                f"(it writes {', '.join(QUANTIZERS)}); trainer and engine must run the same miles"
            )
        self._quantize = QUANTIZERS[quantized["format"]] if quantized else None
        self.quantized: frozenset[str] = frozenset(quantized.get("names", ()))
        self._typed_views: dict[torch.dtype, torch.Tensor] = {}  # the flat buffer viewed as each dtype it holds
        self._views: dict[str, torch.Tensor] | None = None  # by export key, built on first use
        self._slots: dict[str, _Slot] = {}

    def view(self, name: str) -> torch.Tensor:
        """The engine's tensor for HF name `name` (an alias such as a tied lm_head maps to its owner)."""
        return self._slot(name)[0]

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            dst = self._make_view(name)
            size = tensor_nbytes(dst)
            own_copy = self.LARGE_COPY_BYTES is not None and size >= self.LARGE_COPY_BYTES
            slot = self._slots[name] = (dst, dst.shape, dst.dtype, dst.device, size, own_copy)
        return slot

    def _make_view(self, name: str) -> torch.Tensor:
        if self._views is None:
            self._views = self._build_views()
        view = self._views.get(self.aliases.get(name, name))
        if view is None:
            raise ValueError(
                f"the engine has no weight {name!r} (its export lists {len(self.entries)} names, e.g. "
                f"{next(iter(self.entries), None)!r}); trainer and engine must run the same architecture"
            )
        return view

    def _build_views(self) -> dict[str, torch.Tensor]:
        """Every export entry as a view of the flat buffer. Contiguous entries of one dtype come out of a
        single `split` of the buffer (one call for hundreds of views); any other entry is an as_strided view."""
        views: dict[str, torch.Tensor] = {}
        contiguous: dict[torch.dtype, list[tuple[int, int, str, list[int]]]] = {}
        for key, entry in self.entries.items():
            dtype = dtype_from_name(entry["dtype"])
            offset, shape, stride = int(entry["offset"]), list(entry["shape"]), list(entry["stride"])
            if offset % dtype.itemsize:
                raise ValueError(f"export entry {key!r} at byte offset {offset} is not aligned to its {dtype}")
            numel = math.prod(shape)
            extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if numel else 0
            if offset + extent * dtype.itemsize > self.flat.numel():
                raise ValueError(
                    f"export entry {key!r} at offset {offset} runs past the {self.flat.numel()}-byte weight buffer"
                )
            if stride == _contiguous_strides(shape):
                contiguous.setdefault(dtype, []).append((offset // dtype.itemsize, numel, key, shape))
            else:
                views[key] = torch.as_strided(self._typed(dtype), shape, stride, offset // dtype.itemsize)
        for dtype, items in contiguous.items():
            typed = self._typed(dtype)
            sizes: list[int] = []
            keys: list[tuple[str, list[int]] | None] = []
            pos = 0
            for start, numel, key, shape in sorted(items):
                if start < pos:  # overlaps the previous entry: a view of its own
                    views[key] = torch.as_strided(typed, shape, _contiguous_strides(shape), start)
                    continue
                if start > pos:
                    sizes.append(start - pos)  # alignment padding between entries
                    keys.append(None)
                sizes.append(numel)
                keys.append((key, shape))
                pos = start + numel
            sizes.append(typed.numel() - pos)
            keys.append(None)
            for piece, named in zip(typed.split(sizes), keys, strict=True):
                if named is not None:
                    views[named[0]] = piece.view(named[1])
        return views

    def _typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer viewed as `dtype` (whole elements only)."""
        typed = self._typed_views.get(dtype)
        if typed is None:
            size = dtype.itemsize
            typed = self._typed_views[dtype] = self.flat[: self.flat.numel() // size * size].view(dtype)
        return typed

    def write(self, named: Iterable[NamedTensor]) -> tuple[int, int]:
        """Copy every (HF name, tensor) into the engine's view; returns (tensors, bytes) written.

        Copies are issued on the current stream and not waited for (on CPU they are synchronous).
        Same-dtype tensors go out in `_foreach_copy_` batches (see LARGE_COPY_BYTES); a dtype cast is
        its own copy."""
        batches = _Batches(self.BATCH_TENSORS)
        count = nbytes = 0
        slots, quantized = self._slots, self.quantized
        for name, t in named:
            slot = slots.get(name) or self._slot(name)
            if t.shape != slot[1]:
                raise ValueError(f"shape mismatch for {name!r}: trainer {tuple(t.shape)}, engine {tuple(slot[1])}")
            if name in quantized:  # quantized on the engine's device, then its values and scales copied in
                assert self._quantize is not None
                scales = slots.get(name + "_scale_inv") or self._slot(name + "_scale_inv")
                self._quantize(t.to(slot[3], non_blocking=True), (slot[0], scales[0]))
                nbytes += scales[4]
            else:
                batches.add(slot, t)
            count += 1
            nbytes += slot[4]
        batches.finish()
        return count, nbytes


class _Batches:
    """torch's copies: `_foreach_copy_` batches for same-dtype tensors, a copy_ for casts and large ones."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []

    def add(self, slot: _Slot, t: torch.Tensor) -> None:
        dst, _, dtype, device, _, own_copy = slot
        if own_copy or t.dtype != dtype or t.device != device:
            dst.copy_(t, non_blocking=True)
            return
        self.dst.append(dst)
        self.src.append(t)
        if len(self.dst) >= self.batch:
            self.finish()

    def finish(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src, non_blocking=True)
            self.dst, self.src = [], []


def write_into(flat: torch.Tensor, export: dict, named: Iterable[NamedTensor]) -> tuple[int, int]:
    """Copy every (HF name, tensor) into the mapped buffer `flat` described by `export` (one-off writer)."""
    return BufferWriter(flat, export).write(named)


class MappedBuffer:
    """The trainer's mapping of one engine weight buffer (one generation), with its writer.

    CPU: the engine's shared-memory segment mapped as a file under /dev/shm. CUDA: the buffer opened
    from its IPC handle. `close()` unmaps (CUDA: torch syncs this device's stream and closes the handle).
    """

    def __init__(self, export: dict) -> None:
        handle = export["buffer"]
        if handle is None:
            raise ValueError(
                "this weight buffer export carries no handle: ask the engine for it with for_mapping=true "
                "(on CUDA each mapping's export carries the count its close gives back)"
            )
        self.generation = int(export["generation"])
        self._mmap: np.memmap | None = None
        if handle["kind"] == "shm":
            path = shm_path(handle["segment"])
            try:
                self._mmap = np.memmap(path, dtype=np.uint8, mode="r+")
            except FileNotFoundError as exc:
                raise StaleWeightBufferError(
                    f"the engine's weight segment {path} is gone; fetch a fresh export"
                ) from exc
            flat = torch.from_numpy(np.asarray(self._mmap))
        elif handle["kind"] == "cuda_ipc":
            flat = open_cuda_buffer(handle)
        else:
            raise ValueError(f"unknown weight buffer kind {handle['kind']!r}; expected 'shm' or 'cuda_ipc'")
        self.writer: BufferWriter | None = BufferWriter(flat, export)
        self._word: np.memmap | None = None
        if export.get("generation_word"):
            try:
                self._word = np.memmap(shm_path(export["generation_word"]), dtype=np.int64, mode="r", shape=(1,))
            except FileNotFoundError:
                self._word = None  # then every update asks the engine

    def still_current(self) -> bool:
        """True when the engine's published generation is this mapping's: safe to write without asking."""
        return self._word is not None and int(self._word[0]) == self.generation

    @property
    def flat(self) -> torch.Tensor:
        if self.writer is None:
            raise RuntimeError("the weight buffer mapping is closed")
        return self.writer.flat

    def close(self) -> None:
        self.writer = None  # the last references to the mapped tensor and its views
        for mm in (self._mmap, self._word):
            if mm is not None:
                mm._mmap.close()  # noqa: SLF001 - unmap now, not at garbage collection
        self._mmap = self._word = None


@contextmanager
def open_export(export: dict) -> Iterator[torch.Tensor]:
    """Map the engine's weight buffer as a flat uint8 tensor, valid inside the block only."""
    mapped = MappedBuffer(export)
    try:
        yield mapped.flat
    finally:
        mapped.close()
