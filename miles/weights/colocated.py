"""Colocated handoff: trainer and engine share a device, so tensors change hands without a network.

On GPU each tensor travels as a CUDA IPC handle (the engine maps the trainer's memory and
copies straight into its own parameters: one device-to-device copy per byte). On CPU a bucket
is copied once into a named POSIX shared-memory segment that the engine maps. Either way the
payload handed to `update_weights_from_tensor` is a JSON string (names, dtypes, shapes, handles
in base64), never a pickle.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.groups import dtype_from_name, dtype_name
from miles.weights.updater import WeightUpdater

logger = logging.getLogger(__name__)

LOAD_FORMAT = "miles_colocated"


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


# -- trainer side -------------------------------------------------------------------------------


class SharedBucket:
    """One bucket packed into a shared-memory segment; the trainer unlinks it once the engines loaded it."""

    def __init__(self, bucket: list[NamedTensor]) -> None:
        total = sum(tensor_nbytes(t) for _, t in bucket)
        self.shm = shared_memory.SharedMemory(create=True, size=max(total, 1))
        entries, offset = [], 0
        # torch copies into the segment: calling .numpy() on a trainer tensor would pin its storage
        # (non-resizable), and the trainer must still be able to offload it afterwards.
        dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=max(total, 1))
        for name, t in bucket:
            n = tensor_nbytes(t)
            dst[offset : offset + n].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
            entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
            offset += n
        del dst
        self.payload = json.dumps({"kind": "shm", "segment": self.shm.name, "tensors": entries})

    def release(self) -> None:
        self.shm.close()
        self.shm.unlink()


def cuda_ipc_payload(bucket: list[NamedTensor]) -> str:
    """Describe GPU tensors by CUDA IPC handle; the tensors must stay alive until the engine has loaded them."""
    entries = []
    for name, t in bucket:
        _, args = reduce_tensor(t.detach())
        (
            _,
            size,
            stride,
            t_offset,
            _,
            dtype,
            device,
            handle,
            st_size,
            st_offset,
            _,
            rc_handle,
            rc_offset,
            ev_handle,
            ev_sync,
        ) = args
        entries.append(
            {
                "name": name,
                "dtype": dtype_name(dtype),
                "shape": list(size),
                "stride": list(stride),
                "tensor_offset": t_offset,
                "device": device,
                "handle": _b64(handle),
                "storage_bytes": st_size,
                "storage_offset": st_offset,
                "ref_counter_handle": _b64(rc_handle),
                "ref_counter_offset": rc_offset,
                "event_handle": _b64(ev_handle),
                "event_sync_required": ev_sync,
            }
        )
    return json.dumps({"kind": "cuda_ipc", "tensors": entries})


@contextmanager
def handoff(bucket: list[NamedTensor]) -> Iterator[str]:
    """Yield the JSON payload of one bucket; resources are released when the block exits."""
    if bucket and bucket[0][1].is_cuda:
        yield cuda_ipc_payload(bucket)
        return
    shared = SharedBucket(bucket)
    try:
        yield shared.payload
    finally:
        shared.release()


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
        named = [(e["name"], _open_cuda(e)) for e in desc["tensors"]]
        try:
            yield named
        finally:
            named.clear()
    else:
        raise ValueError(f"unknown colocated handoff kind {kind!r}; expected 'shm' or 'cuda_ipc'")


@contextmanager
def _open_shm(desc: dict) -> Iterator[list[NamedTensor]]:
    # Mapped as a plain file under /dev/shm: Python's SharedMemory would register the segment with a
    # resource tracker that the trainer process shares, and unregister it twice.
    path = f"/dev/shm/{desc['segment'].lstrip('/')}"
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r+")
    except FileNotFoundError as exc:
        raise ValueError(f"shared-memory segment {path} is gone; the trainer released it early") from exc
    named: list[NamedTensor] = []
    try:
        flat = torch.from_numpy(np.asarray(mapped))  # load_weights copies out of the mapping
        for e in desc["tensors"]:
            dtype = dtype_from_name(e["dtype"])
            numel = int(np.prod(e["shape"], dtype=np.int64))
            raw = flat[e["offset"] : e["offset"] + numel * dtype.itemsize]
            named.append((e["name"], raw.view(dtype).reshape(e["shape"])))
        yield named
    finally:
        named.clear()
        flat = raw = None
        mapped._mmap.close()  # noqa: SLF001 - release the mapping now, not at garbage collection


def _open_cuda(e: dict) -> torch.Tensor:
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(e["shape"]),
        tuple(e["stride"]),
        e["tensor_offset"],
        torch.storage.TypedStorage,
        dtype_from_name(e["dtype"]),
        e["device"],
        _unb64(e["handle"]),
        e["storage_bytes"],
        e["storage_offset"],
        False,
        _unb64(e["ref_counter_handle"]),
        e["ref_counter_offset"],
        _unb64(e["event_handle"]),
        e["event_sync_required"],
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

        def start(bucket: list[NamedTensor]):
            ctx = handoff(bucket)
            payload = ctx.__enter__()
            if bucket and bucket[0][1].is_cuda:
                torch.cuda.current_stream().synchronize()  # the engine reads on its own stream
            fut = self._start_engines(
                "update_weights_from_tensor",
                lambda i: {
                    "serialized_named_tensors": [payload],
                    "load_format": LOAD_FORMAT,
                    "weight_version": str(version),
                    "flush_cache": False,
                },
                [target],
            )

            def finish() -> None:
                try:
                    self._wait_engines(fut, "update_weights_from_tensor")
                finally:
                    ctx.__exit__(None, None, None)

            return finish

        buckets = self._send_buckets(named, start)
        return {"weight_sync/buckets": float(buckets)}
