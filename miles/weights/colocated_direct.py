"""Direct colocated update: the trainer writes straight into the engine's weights on the same device.

The engine keeps all its weight storage in ONE flat buffer (`WeightArena`: 256-byte aligned
entries, every storage tensor a view of it): a device allocation on GPU, a named POSIX
shared-memory segment on CPU. It exports that buffer once per allocation (a CUDA IPC handle, or the
segment's name) with, for every HF name, the (byte offset, shape, stride, dtype) of the engine's
view, and a `generation` that changes whenever the buffer is reallocated (memory release/resume).

An update (`DirectColocatedUpdater`) is then, per engine: fetch the export, map the buffer once,
`copy_` each (HF name, tensor) the trainer yields into the engine's view (one device-to-device copy
per tensor, cast to the engine dtype, no staging buffer), synchronise the trainer's stream, unmap,
and one install call: the engine checks the generation is still current, bumps its KV epoch (no
KV computed with the old weights is reused) and takes the weight version. The controller pauses the
engines around an update; the engine refuses an export or install while it is generating.

CUDA lifetime: the engine shares its buffer once per generation and drops torch's cross-process
reference count right away, so its release frees the memory at once. That is safe because the
trainer maps the buffer only inside one update: it closes the mapping right after the install call
answers, before the update returns (so before the controller lets generation go on, and long before
any memory release); it never caches a mapping across updates.

Engines without the export (real SGLang: no /miles/export_weight_buffer) keep the per-bucket handoff
of colocated.py; the updater falls back to it on the first update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.colocated import ALIGN_BYTES, ColocatedUpdater, _unb64, open_cuda_buffer, share_cuda_buffer
from miles.weights.groups import dtype_from_name, dtype_name

logger = logging.getLogger(__name__)

EXPORT_ENDPOINT = "/miles/export_weight_buffer"  # miles-only: real SGLang has neither endpoint
INSTALL_ENDPOINT = "/miles/install_weight_buffer"


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

    def export(self, params: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None = None) -> dict:
        """The JSON-able export: buffer handle, generation, and every HF name's place in the buffer."""
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


# -- trainer side -------------------------------------------------------------------------------


@contextmanager
def open_export(export: dict) -> Iterator[torch.Tensor]:
    """Map the engine's weight buffer as a flat uint8 tensor, valid inside the block only."""
    handle = export["buffer"]
    if handle["kind"] == "shm":
        path = f"/dev/shm/{handle['segment'].lstrip('/')}"
        try:
            mapped = np.memmap(path, dtype=np.uint8, mode="r+")
        except FileNotFoundError as exc:
            raise StaleWeightBufferError(f"the engine's weight segment {path} is gone; fetch a fresh export") from exc
        flat = torch.from_numpy(np.asarray(mapped))
        try:
            yield flat
        finally:
            flat = None
            mapped._mmap.close()  # noqa: SLF001 - unmap now, not at garbage collection
    elif handle["kind"] == "cuda_ipc":
        flat = open_cuda_buffer(handle)
        try:
            yield flat
        finally:
            # The last reference goes: torch syncs this device's stream and closes the IPC handle.
            flat = None
    else:
        raise ValueError(f"unknown weight buffer kind {handle['kind']!r}; expected 'shm' or 'cuda_ipc'")


BATCH_TENSORS = 32  # copies are issued in batches of this many (one foreach launch each), so the GPU
BATCH_BYTES = 256 << 20  # starts copying while the host is still building the next views


def write_into(flat: torch.Tensor, export: dict, named: Iterable[NamedTensor]) -> tuple[int, int]:
    """Copy every (HF name, tensor) into the engine's view; returns (tensors, bytes) written.

    One copy per tensor, cast to the engine dtype. Same-dtype copies go out in batches through
    `_foreach_copy_` (a few launches for many tensors), each batch as soon as it is full: the host's
    per-tensor work (one as_strided view each) then overlaps the copies already on the GPU.
    """
    entries, aliases = export["tensors"], export.get("aliases", {})
    typed: dict[torch.dtype, torch.Tensor] = {}  # the flat buffer viewed as each dtype it holds
    batch_dst: list[torch.Tensor] = []
    batch_src: list[torch.Tensor] = []
    batch_bytes = count = nbytes = 0
    for name, t in named:
        key = aliases.get(name, name)
        entry = entries.get(key)
        if entry is None:
            raise ValueError(
                f"the engine has no weight {name!r} (its export lists {len(entries)} names, e.g. "
                f"{next(iter(entries), None)!r}); trainer and engine must run the same architecture"
            )
        if list(t.shape) != entry["shape"]:
            raise ValueError(f"shape mismatch for {name!r}: trainer {tuple(t.shape)}, engine {tuple(entry['shape'])}")
        dtype = dtype_from_name(entry["dtype"])
        if dtype not in typed:
            size = dtype.itemsize
            typed[dtype] = flat[: flat.numel() // size * size].view(dtype)
        offset = int(entry["offset"])
        if offset % dtype.itemsize:
            raise ValueError(f"export entry {key!r} at byte offset {offset} is not aligned to its {dtype}")
        dst = torch.as_strided(typed[dtype], entry["shape"], entry["stride"], offset // dtype.itemsize)
        size = tensor_nbytes(dst)
        if offset + size > flat.numel():
            raise ValueError(
                f"export entry {key!r} at offset {offset} runs past the {flat.numel()}-byte weight buffer"
            )
        if dst.dtype == t.dtype and dst.device == t.device:
            batch_dst.append(dst)
            batch_src.append(t)
            batch_bytes += size
            if len(batch_dst) >= BATCH_TENSORS or batch_bytes >= BATCH_BYTES:
                torch._foreach_copy_(batch_dst, batch_src, non_blocking=True)
                batch_dst, batch_src, batch_bytes = [], [], 0
        else:
            dst.copy_(t, non_blocking=True)  # a cast (or another device): its own copy
        count += 1
        nbytes += size
    if batch_dst:
        torch._foreach_copy_(batch_dst, batch_src, non_blocking=True)
    return count, nbytes


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
    """

    mode = "colocated"

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        self.direct: bool | None = None  # None until the first update asked the engine

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender or self.direct is False:
            return super()._transfer(named, version)
        target = self.trainer_rank
        export = self._run(_post_miles(self.engines[target], "export_weight_buffer", {}))
        if export is None:
            logger.info("engine %d has no %s; using the per-bucket colocated handoff", target, EXPORT_ENDPOINT)
            self.direct = False
            return super()._transfer(named, version)
        self.direct = True
        payload = {"generation": export["generation"], "weight_version": str(version)}
        with open_export(export) as flat:
            # timed from the first copy issued (the mapping is open) to the install call answered
            t0 = time.perf_counter()
            tensors, _ = write_into(flat, export, named)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            copy_s = time.perf_counter() - t0
            # install while still mapped: the engine serves the new weights once it answers; unmapping
            # is the trainer's cleanup and still happens before this update returns (before any release)
            self._run(_post_miles(self.engines[target], "install_weight_buffer", payload))
            direct_s = time.perf_counter() - t0
        unmap_s = time.perf_counter() - t0 - direct_s
        self.version_installed = True
        return {
            "weight_sync/buckets": 0.0,
            "weight_sync/direct_tensors": float(tensors),
            "weight_sync/direct_copy_seconds": copy_s,  # copies and the stream sync
            "weight_sync/direct_seconds": direct_s,  # ... plus the install call
            "weight_sync/direct_unmap_seconds": unmap_s,  # closing the mapping afterwards
        }
