"""Colocated handoff: trainer and engine share a device, so tensors change hands without a network.

Each bucket is packed once into one flat buffer that the engine maps, copying every tensor out
of it into its own parameters: a named POSIX shared-memory segment on CPU, a fresh device
allocation shared by one CUDA IPC handle on GPU. One handle per bucket, not per tensor: each
handle costs the engine an IPC open and close every update, and torch's receiving side opens an
IPC event per handle that it never destroys. The payload handed to `update_weights_from_tensor`
is a JSON string (names, dtypes, shapes, offsets, handles in base64), never a pickle.

CUDA ordering and lifetime: the trainer fills the buffer on its current stream and synchronises
that stream before the handle leaves the process, so the engine may read on any stream without
waiting on an event. torch counts the engine's mapping in a shared reference counter: the
trainer's buffer is freed only after the engine dropped its mapping, even if the trainer lets go
first. The engine copies, synchronises its device and drops the mapping before it answers; the
trainer releases the buffer once the answer is in, so a finished update leaves nothing behind.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from miles.weights.base import WeightUpdater
from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.groups import dtype_from_name, dtype_name

logger = logging.getLogger(__name__)

LOAD_FORMAT = "miles_colocated"
SHM_DIR = "/dev/shm"
ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary of the flat buffer (aligned, vectorised copies)


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def pack_layout(bucket: list[NamedTensor]) -> tuple[list[dict], int]:
    """Where each tensor goes in the flat buffer: entries (name, dtype, shape, offset) and the total bytes."""
    entries, offset = [], 0
    for name, t in bucket:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += tensor_nbytes(t)
    return entries, max(offset, 1)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# -- trainer side -------------------------------------------------------------------------------


class SharedBucket:
    """One bucket packed into a shared-memory segment; the trainer unlinks it once the engines loaded it."""

    def __init__(self, bucket: list[NamedTensor]) -> None:
        entries, total = pack_layout(bucket)
        self.shm = shared_memory.SharedMemory(create=True, size=total)
        # torch copies into the segment: calling .numpy() on a trainer tensor would pin its storage
        # (non-resizable), and the trainer must still be able to offload it afterwards.
        dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=total)
        for e, (_, t) in zip(entries, bucket, strict=True):
            dst[e["offset"] : e["offset"] + tensor_nbytes(t)].copy_(_as_bytes(t.cpu()))
        del dst
        self.payload = json.dumps({"kind": "shm", "segment": self.shm.name, "tensors": entries})

    def release(self) -> None:
        self.shm.close()
        self.shm.unlink()


class CudaBucket:
    """One bucket packed into a fresh device buffer, described by its CUDA IPC handle."""

    def __init__(self, bucket: list[NamedTensor]) -> None:
        device = bucket[0][1].device
        if any(t.device != device for _, t in bucket):
            raise ValueError(
                f"a colocated bucket mixes devices {sorted({str(t.device) for _, t in bucket})}; "
                "the trainer must hand over every tensor from its own GPU"
            )
        entries, total = pack_layout(bucket)
        self.flat: torch.Tensor | None = torch.empty(total, dtype=torch.uint8, device=device)
        for e, (_, t) in zip(entries, bucket, strict=True):
            self.flat[e["offset"] : e["offset"] + tensor_nbytes(t)].copy_(_as_bytes(t))
        # The engine reads without waiting on an event: every byte is in place before the handle leaves.
        torch.cuda.current_stream(device).synchronize()
        buffer = share_cuda_buffer(self.flat)
        self.payload = json.dumps({"kind": "cuda_ipc", "buffer": buffer, "tensors": entries})

    def release(self) -> None:
        # Freed now if the engine dropped its mapping (it does so before answering); otherwise torch
        # keeps the block until the engine's reference counter reaches zero.
        self.flat = None


def share_cuda_buffer(flat: torch.Tensor) -> dict:
    """The JSON-able CUDA IPC description of a flat uint8 device tensor (torch's reduce_tensor fields)."""
    _, args = reduce_tensor(flat)
    (
        _,
        size,
        stride,
        tensor_offset,
        _,
        _,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        _,
    ) = args
    return {
        "nbytes": int(size[0]),
        "stride": list(stride),
        "tensor_offset": tensor_offset,
        "device": device,
        "device_uuid": _device_uuid(device),
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
    }


def pack(bucket: list[NamedTensor]) -> SharedBucket | CudaBucket:
    """Pack one bucket for the engine on the same device; call `.release()` once the engine answered."""
    if not bucket:
        raise ValueError("pack() got an empty bucket")
    return CudaBucket(bucket) if bucket[0][1].is_cuda else SharedBucket(bucket)


def _device_uuid(index: int) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


# -- engine side --------------------------------------------------------------------------------


@contextmanager
def open_payload(payload: str) -> Iterator[list[NamedTensor]]:
    """Map a handoff payload to (name, tensor) views of the trainer's memory, valid inside the block only."""
    try:
        desc = json.loads(payload)
        kind = desc["kind"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"update_weights_from_tensor payload is not a miles colocated handoff: {exc}") from exc
    if kind == "shm":
        with _open_shm(desc) as named:
            yield named
    elif kind == "cuda_ipc":
        with _open_cuda(desc) as named:
            yield named
    else:
        raise ValueError(f"unknown colocated handoff kind {kind!r}; expected 'shm' or 'cuda_ipc'")


def _views(flat: torch.Tensor, entries: list[dict]) -> list[NamedTensor]:
    named = []
    for e in entries:
        dtype = dtype_from_name(e["dtype"])
        numel = int(np.prod(e["shape"], dtype=np.int64))
        raw = flat[e["offset"] : e["offset"] + numel * dtype.itemsize]
        named.append((e["name"], raw.view(dtype).reshape(e["shape"])))
    return named


def shm_path(segment: object) -> str:
    """The file of a POSIX shared-memory segment: a plain name (one optional leading '/'), under /dev/shm.

    The name comes over HTTP, so anything that could lead elsewhere (a '/', '..', a NUL, a symlink
    out of /dev/shm) is refused with ValueError (HTTP 400).
    """
    name = segment[1:] if isinstance(segment, str) and segment.startswith("/") else segment
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(
            f"shared-memory segment {segment!r} is not a plain segment name (like 'psm_1a2b'); "
            f"it must name a file directly under {SHM_DIR}"
        )
    path = os.path.join(SHM_DIR, name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(SHM_DIR):
        raise ValueError(f"shared-memory segment {segment!r} links out of {SHM_DIR}; refused")
    return path


@contextmanager
def _open_shm(desc: dict) -> Iterator[list[NamedTensor]]:
    # Mapped as a plain file under /dev/shm: Python's SharedMemory would register the segment with a
    # resource tracker that the trainer process shares, and unregister it twice.
    path = shm_path(desc.get("segment"))
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r+")
    except FileNotFoundError as exc:
        raise ValueError(f"shared-memory segment {path} is gone; the trainer released it early") from exc
    named: list[NamedTensor] = []
    try:
        flat = torch.from_numpy(np.asarray(mapped))  # load_weights copies out of the mapping
        named = _views(flat, desc["tensors"])
        yield named
    finally:
        named.clear()
        flat = None
        mapped._mmap.close()  # noqa: SLF001 - release the mapping now, not at garbage collection


@contextmanager
def _open_cuda(desc: dict) -> Iterator[list[NamedTensor]]:
    flat = open_cuda_buffer(desc["buffer"])
    named = _views(flat, desc["tensors"])
    try:
        yield named
    finally:
        # The last reference to the mapping goes here: torch syncs this device's current stream,
        # decrements the trainer's reference counter and closes the IPC handle.
        named.clear()
        flat = None


def open_cuda_buffer(b: dict) -> torch.Tensor:
    """Map a flat uint8 device buffer from its `share_cuda_buffer` description (one IPC open)."""
    device = local_cuda_index(b.get("device_uuid"), int(b["device"]))
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([b["nbytes"]]),
        tuple(b["stride"]),
        b["tensor_offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        _unb64(b["handle"]),
        b["storage_bytes"],
        b["storage_offset"],
        False,
        _unb64(b["ref_counter_handle"]),
        b["ref_counter_offset"],
        _unb64(b["event_handle"]),
        False,  # no event wait: the producer synchronised before sharing (an opened IPC event is never freed)
    )


def local_cuda_index(uuid: str | None, index: int) -> int:
    """This process's index of the trainer's GPU (CUDA_VISIBLE_DEVICES may number it differently)."""
    if uuid is None:
        return index
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid:
            return i
    raise ValueError(
        f"the trainer's GPU {uuid} is not visible to this engine "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
        "the colocated handoff needs the engine on the trainer's GPU"
    )


# -- trainer-side updater -----------------------------------------------------------------------


class ColocatedUpdater(WeightUpdater):
    """Hands each bucket to the engine on the same device; trainer rank i serves engine i."""

    mode = "colocated"

    @property
    def is_sender(self) -> bool:
        return self.trainer_rank < len(self.engines)

    def _connect(self, master_address: str, master_port: int | None) -> None:
        pass

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender:
            for _ in named:
                pass
            return {}
        target = self.trainer_rank
        pack_s = 0.0

        def start(bucket: list[NamedTensor]):
            nonlocal pack_s
            t0 = time.perf_counter()
            packed = pack(bucket)
            pack_s += time.perf_counter() - t0
            try:
                fut = self._start_engines(
                    "update_weights_from_tensor",
                    lambda i: {
                        "serialized_named_tensors": [packed.payload],
                        "load_format": LOAD_FORMAT,
                        "weight_version": str(version),
                        "flush_cache": False,
                    },
                    [target],
                )
            except BaseException:
                packed.release()
                raise

            def finish() -> None:
                try:
                    self._wait_engines(fut, "update_weights_from_tensor")
                finally:
                    packed.release()

            return finish

        buckets = self._send_buckets(named, start)
        # pack_seconds: the trainer's share (copies into the flat buffers, waited for, and the IPC handles)
        return {"weight_sync/buckets": float(buckets), "weight_sync/pack_seconds": pack_s}

    def _close(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # buffers whose engine answered late (after a timeout) are freed here
