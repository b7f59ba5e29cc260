"""The engine's side of direct colocated updates: its weights in one flat buffer it exports by handle.

The engine keeps all its weight storage in ONE flat buffer (`WeightArena`: 256-byte aligned
entries, every storage tensor a view of it): a device allocation on GPU, a named POSIX
shared-memory segment on CPU. It exports that buffer (a CUDA IPC handle, or the segment's name)
with, for every HF name, the (byte offset, shape, stride, dtype) of the engine's view, and a
`generation` that changes whenever the buffer is reallocated (a memory release and resume); the
current generation is also published in eight bytes of shared memory (`GenerationWord`, 0 before
a buffer is freed). `SharedWeights` holds the current arena and the word; `wait_for_writer` orders
the engine's stream after the trainer's copies. The protocol as a whole: miles/weights/colocated_direct.py.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from multiprocessing import shared_memory
from typing import Any

import torch

from miles.weights.bucket import tensor_nbytes
from miles.weights.groups import dtype_name
from miles.weights.tensor_ipc import ALIGN_BYTES, share_cuda_buffer, unb64

# An FP8 engine's quantized weights in its buffer: e4m3 values and one fp32 scale_inv per 128x128 block
# (miles/engines/embedded/fp8.py), written by the trainer's `BufferWriter` after quantizing each tensor.
FP8_BLOCK128 = "fp8_e4m3_block128"


class StaleWeightBufferError(ValueError):
    """The engine reallocated its weight buffer after the trainer fetched the export."""


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
            self.flat = torch.frombuffer(_own_mapping(self._shm), dtype=torch.uint8, count=self.nbytes)
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

    def export(
        self,
        params: Mapping[str, Any],
        aliases: Mapping[str, str] | None = None,
        known_generation: int | None = None,
        generation_word: str | None = None,
        quantized_format: str | None = None,
        for_mapping: bool = False,
    ) -> dict:
        """The JSON-able export: buffer handle, generation, and every HF name's place in the buffer.

        On CUDA the buffer handle comes only `for_mapping` (a caller that will open it: see `_buffer_handle`);
        otherwise `buffer` is None there (the names and places alone).

        A quantized weight (an object with `q` and `scale_inv` tensors, as the FP8 engine keeps them) is
        exported the way an FP8 checkpoint names it: `name` for its e4m3 values and `name + "_scale_inv"` for
        its block scales, and `quantized` = {"format": quantized_format, "names": [...]} tells the writer to
        quantize those names' tensors before writing them. A caller that already maps generation
        `known_generation` gets `{"generation", "unchanged": True}` when that is still the current one."""
        if known_generation is not None and int(known_generation) == self.generation:
            return {"generation": self.generation, "unchanged": True}
        entries, quantized = {}, []
        for name, t in params.items():
            scale_inv = getattr(t, "scale_inv", None)
            if scale_inv is None:
                entries[name] = self._entry(name, t)
                continue
            if quantized_format is None:
                raise ValueError(f"engine weight {name!r} is quantized; export it with its quantized_format")
            entries[name] = self._entry(name, t.q)
            entries[name + "_scale_inv"] = self._entry(name + "_scale_inv", scale_inv)
            quantized.append(name)
        out = {
            "generation": self.generation,
            "nbytes": self.nbytes,
            "buffer": self._buffer_handle(for_mapping),
            "tensors": entries,
            "aliases": dict(aliases or {}),
            "generation_word": generation_word,
        }
        if quantized:
            out["quantized"] = {"format": quantized_format, "names": quantized}
        return out

    def _entry(self, name: str, t: torch.Tensor) -> dict:
        offset = t.data_ptr() - self.flat.data_ptr()
        if t.numel() and not 0 <= offset <= self.nbytes - t.element_size():
            raise ValueError(f"engine weight {name!r} is not inside the shared weight buffer; repack it")
        return {"offset": offset, "shape": list(t.shape), "stride": list(t.stride()), "dtype": dtype_name(t.dtype)}

    def _buffer_handle(self, for_mapping: bool) -> dict | None:
        """The buffer's handle for one export. On CUDA every export for a mapping shares the buffer anew: torch
        gives each share a reference count of one (an unsigned counter in shared memory), which the mapping made
        from it gives back when it closes (or at once, where that process still maps the buffer), and at the
        engine's release keeps the block in its IPC "limbo" while any count is positive. One count per mapping is
        that protocol: a trainer that closes its mapping before the engine releases (colocated_direct.py) lets the
        release free the buffer at once, and one that still maps it frees it when it closes (the engine collects
        the limbo at its next release or export). An export for no mapping shares nothing (`buffer` None), so it
        leaves no count behind. (Sharing once per buffer and dropping the count at once, as this did before, took
        the counter below zero at a trainer's close: it wrapped around, and every buffer released after one
        stayed in limbo, one weight push's worth of device memory a step: bench/results/gsm.md, Run E.)"""
        if self._shm is not None:
            return {"kind": "shm", "segment": self._shm.name}
        if not for_mapping:
            return None
        torch.cuda.ipc_collect()  # earlier buffers whose last mapping has closed since their release go now
        return {"kind": "cuda_ipc", **share_cuda_buffer(self.flat)}

    def close(self) -> None:
        """Drop the buffer (on CPU: unlink the segment's name; its memory stays mapped while any view of
        it lives, and is freed with the last one)."""
        self.views.clear()
        self.flat = None  # type: ignore[assignment]
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None


def _own_mapping(shm: shared_memory.SharedMemory) -> mmap.mmap | memoryview:
    """A mapping of `shm`'s segment that nothing closes while a tensor over it lives. The segment object's
    own mapping is closed when that object is collected (its `close()`, run by `__del__`, unmaps it even
    while tensors still point into it: reading an engine weight after its shutdown crashed the process);
    a second mapping, referenced only by the tensors made from it, is unmapped with the last of them.
    Where the segment has no path to map again (not Linux), the segment object's buffer is used."""
    path = os.path.join("/dev/shm", shm.name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return shm.buf
    try:
        return mmap.mmap(fd, shm.size)
    finally:
        os.close(fd)


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
        self,
        params: Mapping[str, Any],
        aliases: Mapping[str, str] | None,
        known_generation: int | None,
        quantized_format: str | None = None,
        for_mapping: bool = False,
    ) -> dict:
        assert self.arena is not None and self._word is not None, "pack() before export()"
        return self.arena.export(params, aliases, known_generation, self._word.name, quantized_format, for_mapping)

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
        event = torch.cuda.Event.from_ipc_handle(torch.device(device), unb64(ready_event))
        _WRITER_EVENTS[ready_event] = event
    torch.cuda.current_stream(torch.device(device)).wait_event(event)
