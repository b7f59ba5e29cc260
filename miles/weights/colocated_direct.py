"""Direct colocated update: the trainer writes straight into the engine's weights on the same device.

The engine keeps all its weight storage in ONE flat buffer (`WeightArena`: 256-byte aligned
entries, every storage tensor a view of it): a device allocation on GPU, a named POSIX
shared-memory segment on CPU. It exports that buffer (a CUDA IPC handle, or the segment's name)
with, for every HF name, the (byte offset, shape, stride, dtype) of the engine's view, and a
`generation` that changes whenever the buffer is reallocated (a memory release and resume).

An update (`DirectColocatedUpdater`) per engine:
1. makes sure the buffer it maps is still the engine's: the engine publishes its current
   generation in eight bytes of shared memory (`GenerationWord`), which the trainer reads; only when
   it changed (or at first) does the trainer ask for the export over HTTP, map the new buffer and
   build its per-name views once;
2. copies each (HF name, tensor) the trainer yields into the engine's view, device to device, cast to
   the engine dtype, no staging buffer: same-dtype tensors in `_foreach_copy_` batches of 64;
3. records an inter-process CUDA event behind the copies and makes one install call carrying it:
   the engine makes its stream wait for that event (the call and its answer travel while the GPU
   still copies), checks the generation is still current, bumps its KV epoch (no KV computed with
   the old weights is reused) and takes the weight version. The update returns once the answer is
   in and the trainer's stream has finished the copies; only then does the controller let
   generation go on.
The controller pauses the engines around an update; the engine refuses an export or install while
it is generating.

Mapping lifetime: the engine shares its buffer once per generation and drops torch's cross-process
reference count right away, so its own release frees the memory at once. With `keep_mapping`
(the default) the trainer keeps its mapping and views between updates and never writes into them
unless step 1 found the generation still current (the engine publishes 0 before it frees a buffer;
the controller never releases engine memory during an update); a run whose engines
release their weights between updates (`--offload-rollout-level` with `weight`) makes the updater
close its mapping at the end of every update instead, so nothing of the trainer pins the buffer
the engine is about to free.

Engines without the export (real SGLang: no /miles/export_weight_buffer) keep the per-bucket handoff
of colocated.py; the updater falls back to it on the first update.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from miles.weights.base import EngineCallError
from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.colocated import (
    ALIGN_BYTES,
    ColocatedUpdater,
    _b64,
    _unb64,
    open_cuda_buffer,
    share_cuda_buffer,
    shm_path,
)
from miles.weights.groups import dtype_from_name, dtype_name

logger = logging.getLogger(__name__)

EXPORT_ENDPOINT = "/miles/export_weight_buffer"  # miles-only, like its install endpoint: SGLang has neither


class StaleWeightBufferError(ValueError):
    """The engine reallocated its weight buffer after the trainer fetched the export."""


# -- engine side --------------------------------------------------------------------------------


class WeightArena:
    """One flat buffer holding copies of `tensors` (by key), each entry 256-byte aligned.

    `views[key]` is the entry as a tensor of the original dtype and shape; the engine swaps its
    storage for these views. On CPU the buffer is a shared-memory segment the engine owns and
    unlinks in `close()`.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], device: torch.device | str, generation: int) -> None:
        self.device = torch.device(device)
        self.generation = generation
        offsets, total = {}, 0
        for key, t in tensors.items():
            total = -(-total // ALIGN_BYTES) * ALIGN_BYTES
            offsets[key] = total
            total += tensor_nbytes(t)
        self.nbytes = max(total, 1)
        self._shm: shared_memory.SharedMemory | None = None
        if self.device.type == "cpu":
            self._shm = shared_memory.SharedMemory(create=True, size=self.nbytes)
            self.flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.nbytes)
        else:
            self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            raw = self.flat[offsets[key] : offsets[key] + tensor_nbytes(t)]
            view = raw.view(t.dtype).view(t.shape)
            view.copy_(t)
            self.views[key] = view
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._handle: dict | None = None

    def export(
        self,
        params: Mapping[str, torch.Tensor],
        aliases: Mapping[str, str] | None = None,
        known_generation: int | None = None,
        generation_word: str | None = None,
    ) -> dict:
        """The JSON-able export: buffer handle, generation, and every HF name's place in the buffer.

        A caller that already maps generation `known_generation` gets `{"generation", "unchanged": True}`
        when that is still the current one."""
        if known_generation is not None and int(known_generation) == self.generation:
            return {"generation": self.generation, "unchanged": True}
        base = self.flat.data_ptr()
        entries = {}
        for name, t in params.items():
            offset = t.data_ptr() - base
            if t.numel() and not 0 <= offset <= self.nbytes - t.element_size():
                raise ValueError(f"engine weight {name!r} is not inside the shared weight buffer; repack it")
            entries[name] = {
                "offset": offset,
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": dtype_name(t.dtype),
            }
        return {
            "generation": self.generation,
            "nbytes": self.nbytes,
            "buffer": self._buffer_handle(),
            "tensors": entries,
            "aliases": dict(aliases or {}),
            "generation_word": generation_word,
        }

    def _buffer_handle(self) -> dict:
        if self._handle is None:
            if self._shm is not None:
                self._handle = {"kind": "shm", "segment": self._shm.name}
            else:
                self._handle = {"kind": "cuda_ipc", **share_cuda_buffer(self.flat)}
                # torch counts consumers in a shared counter and keeps a shared block alive while it is
                # positive; trainers map this buffer only inside an update, so the engine's release
                # must free it at once: drop the count now (the trainer's unmaps take it below zero).
                torch.UntypedStorage._release_ipc_counter_cuda(  # noqa: SLF001
                    _unb64(self._handle["ref_counter_handle"]), self._handle["ref_counter_offset"]
                )
        return self._handle

    def close(self) -> None:
        """Drop the buffer (on CPU: unlink the segment; the engine's views keep the mapping alive)."""
        self.views.clear()
        self.flat = None  # type: ignore[assignment]
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None


class GenerationWord:
    """Eight bytes of shared memory in which an engine publishes its weight buffer's generation (0: none).

    A trainer that keeps the buffer mapped reads it before writing instead of asking the engine
    over HTTP. The engine publishes 0 before it frees a buffer and the new generation once a new
    buffer holds the weights."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=8)
        self.name = self._shm.name
        self.publish(0)

    def publish(self, generation: int) -> None:
        assert self._shm is not None
        struct.pack_into("<q", self._shm.buf, 0, generation)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None


class SharedWeights:
    """An engine's side of direct colocated updates: its current `WeightArena`, the generation counter
    and the `GenerationWord`. Generations start at a random base, so a restarted engine never
    reuses the generation a trainer may still map."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.arena: WeightArena | None = None
        self._next = int.from_bytes(os.urandom(4), "little") << 16
        self._word: GenerationWord | None = None

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `tensors` into a fresh buffer (a new generation); returns their views in it."""
        if self._word is None:
            self._word = GenerationWord()
        self._next += 1
        old, self.arena = self.arena, WeightArena(tensors, self.device, self._next)
        self._word.publish(self._next)
        if old is not None:
            old.close()
        return dict(self.arena.views)

    def drop(self) -> None:
        """Forget the buffer (a memory release): trainers see generation 0 before it is freed."""
        if self._word is not None:
            self._word.publish(0)
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def export(
        self, params: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None, known_generation: int | None
    ) -> dict:
        assert self.arena is not None and self._word is not None, "pack() before export()"
        return self.arena.export(params, aliases, known_generation, self._word.name)

    def check_install(self, generation: int) -> None:
        current = self.arena.generation if self.arena is not None else None
        if current != int(generation):
            raise StaleWeightBufferError(
                f"weights were written into weight buffer generation {generation}, but the engine's buffer is "
                f"now {current} (memory was released or resumed mid-update); push the weights again"
            )

    def close(self) -> None:
        self.drop()
        if self._word is not None:
            self._word.close()
            self._word = None


_WRITER_EVENTS: dict[str, Any] = {}  # opened inter-process events by handle; a trainer reuses one per engine


def wait_for_writer(ready_event: str | None, device: torch.device | str) -> None:
    """Order the engine's work after the trainer's copies behind `ready_event` (a base64 CUDA IPC event
    handle): the current stream of `device` waits for the event, the host does not.

    Engines call this first thing in `install_weight_buffer`, so their answer travels back while the
    GPU may still copy; the trainer's update returns only after its own stream finished the copies,
    and generation goes on only after that. None (CPU, or an older trainer that synchronised its
    stream before calling) returns at once."""
    if ready_event is None:
        return
    event = _WRITER_EVENTS.get(ready_event)
    if event is None:
        if len(_WRITER_EVENTS) >= 64:  # trainers come and go (restarts): keep the table small
            _WRITER_EVENTS.clear()
        event = torch.cuda.Event.from_ipc_handle(torch.device(device), _unb64(ready_event))
        _WRITER_EVENTS[ready_event] = event
    torch.cuda.current_stream(torch.device(device)).wait_event(event)


# -- trainer side -------------------------------------------------------------------------------


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
        slots = self._slots
        for name, t in named:
            slot = slots.get(name) or self._slot(name)
            if t.shape != slot[1]:
                raise ValueError(f"shape mismatch for {name!r}: trainer {tuple(t.shape)}, engine {tuple(slot[1])}")
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


# -- trainer-side updater -----------------------------------------------------------------------


async def _post_miles(engine: Any, method: str, payload: dict) -> dict | None:
    """Call a miles-only weight endpoint; None when the engine does not have it (HTTP 404)."""
    fn = getattr(type(engine), method, None)
    if fn is not None:  # fake engines and clients that name the endpoint
        return await getattr(engine, method)(**payload)
    status, body = await engine.request("POST", f"/miles/{method}", payload, ok_statuses=(404,))
    return None if status == 404 else body


class DirectColocatedUpdater(ColocatedUpdater):
    """Writes into the weight buffer of the engine on the same device; trainer rank i serves engine i.

    Falls back to the per-bucket handoff (`ColocatedUpdater`) for an engine without the export.
    `keep_mapping=False` closes the mapping at the end of every update (engines that release their
    weights between updates); otherwise it is kept while the engine's buffer generation is unchanged.
    """

    mode = "colocated"

    def __init__(self, cfg=None, *, keep_mapping: bool = True) -> None:
        super().__init__(cfg)
        self.direct: bool | None = None  # None until the first update asked the engine
        self.keep_mapping = keep_mapping
        self._mapped: MappedBuffer | None = None
        self._ready: torch.cuda.Event | None = None  # recorded behind the copies, waited for by the engine
        self._ready_handle: str | None = None

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender or self.direct is False or self.exchanges:  # engines of several GPUs: SGLang's path
            return super()._transfer(named, version)
        t0 = time.perf_counter()
        if self._mapped is not None and self._mapped.still_current():
            export = {"generation": self._mapped.generation, "unchanged": True}
        else:
            known = {} if self._mapped is None else {"generation": self._mapped.generation}
            export = self._call_engine("export_weight_buffer", known)
        if export is None:
            logger.info(
                "engine %d has no %s; using the per-bucket colocated handoff", self.trainer_rank, EXPORT_ENDPOINT
            )
            self.direct = False
            return super()._transfer(named, version)
        self.direct = True
        t_map = time.perf_counter()
        try:
            if not export.get("unchanged"):
                self._drop_mapping()
                self._mapped = MappedBuffer(export)
            mapped = self._mapped
            assert mapped is not None and mapped.writer is not None
            t_copy = time.perf_counter()
            tensors, _ = mapped.writer.write(named)
            payload = {"generation": mapped.generation, "weight_version": str(version)}
            stream = torch.cuda.current_stream(mapped.flat.device) if mapped.flat.is_cuda else None
            if stream is not None:
                payload["ready_event"] = self._record_ready(stream)
            t_install = time.perf_counter()
            self._call_engine("install_weight_buffer", payload)
            if stream is not None:
                stream.synchronize()  # the copies are done: the engine may serve, the trainer reuse its tensors
            t_done = time.perf_counter()
        except BaseException:
            self._drop_mapping()  # a stale or failed write: map afresh next time
            raise
        if not self.keep_mapping:
            self._drop_mapping()
        self.version_installed = True
        return {
            "weight_sync/buckets": 0.0,
            "weight_sync/direct_tensors": float(tensors),
            "weight_sync/direct_export_seconds": t_map - t0,  # generation check, or the export call
            "weight_sync/direct_map_seconds": t_copy - t_map,  # opening a new buffer (0 when kept)
            "weight_sync/direct_issue_seconds": t_install - t_copy,  # the host issuing the copies
            "weight_sync/direct_seconds": t_done - t_copy,  # first copy issued -> install answered
            "weight_sync/direct_unmap_seconds": time.perf_counter() - t_done,
        }

    def _call_engine(self, method: str, payload: dict) -> dict | None:
        """One miles-only call to this rank's engine; a failure or timeout names the engine."""
        engine = self.engines[self.trainer_rank]
        try:
            return self._run(asyncio.wait_for(_post_miles(engine, method, payload), self.timeout_s))
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise EngineCallError(
                f"engine {self.trainer_rank} ({engine!r}) did not finish {method} within {self.timeout_s}s"
            ) from exc
        except Exception as exc:
            raise EngineCallError(
                f"engine {self.trainer_rank} ({engine!r}) failed {method}: {type(exc).__name__}: {exc}"
            ) from exc

    def _record_ready(self, stream: torch.cuda.Stream) -> str:
        if self._ready is None:
            self._ready = torch.cuda.Event(interprocess=True)
            self._ready.record(stream)
            self._ready_handle = _b64(self._ready.ipc_handle())
        else:
            self._ready.record(stream)
        assert self._ready_handle is not None
        return self._ready_handle

    def _drop_mapping(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None

    def close(self) -> None:
        self._drop_mapping()
        super().close()
