"""Tensors that change hands between processes on one device: SGLang's `update_weights_from_tensor` payload.

The payload is SGLang's own for `/update_weights_from_tensor` (load_format null):
`serialized_named_tensors` holds one string per tensor-parallel rank of the engine, each the
base64 of a pickle of `[(HF name, tensor), ...]` as SGLang's `MultiprocessingSerializer` writes
it, so a vanilla SGLang server and the embedded engine load the same bytes. The tensors of a
bucket are views of one flat buffer the trainer packs once: on GPU a fresh device allocation
that travels as a CUDA IPC handle (torch's own reduction, the device named by its UUID as
SGLang's patched reduction does, since the engine's processes number GPUs differently); on CPU
a storage in torch's shared memory (the `file_system` reduction, which a process that did not
fork from the trainer can open). Every view of the buffer references the same handle, so the
engine opens it once per bucket, and no IPC event travels: the trainer synchronises its stream
before the handle leaves the process.

CUDA lifetime: torch counts the engine's mapping in a shared reference counter, so the trainer's
buffer is freed only after the engine dropped its mapping, even if the trainer lets go first.
The engine copies, synchronises its device and drops the mapping before it answers.
The engine side (`open_payload`) unpickles with an allow-list of exactly the globals this
format uses (torch's tensor and storage rebuild functions, torch types and dtypes), and names a
shared-memory file only directly under /dev/shm.

Also here: the JSON-able description of one flat CUDA buffer (`share_cuda_buffer`,
`open_cuda_buffer`) and the checked path of a shared-memory segment (`shm_path`), which the
direct colocated update (miles/weights/colocated_direct.py) maps.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing import reductions
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.groups import dtype_name

SHM_DIR = "/dev/shm"
ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary of the flat buffer (aligned, vectorised copies)
_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor arguments (SGLang's patch uses it too)
_EVENT_SYNC_ARG = 14  # index of event_sync_required


def b64(b: bytes | None) -> str | None:
    """Bytes (a handle) as base64 text for JSON; None stays None."""
    return None if b is None else base64.b64encode(b).decode()


def unb64(s: str | None) -> bytes | None:
    """The inverse of `b64`."""
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


class _TensorPickler(pickle.Pickler):
    """Pickles tensors as SGLang's MultiprocessingSerializer does (torch's multiprocessing reductions), with
    two choices made for a receiver that did not fork from the trainer: CPU storages by shared-memory file
    name, CUDA devices by UUID (and no IPC event: the trainer synchronised before sharing)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            rebuild, args = reduce_tensor(obj)
            if rebuild is rebuild_cuda_tensor:
                args = list(args)
                args[_DEVICE_ARG] = _device_uuid(args[_DEVICE_ARG]) or args[_DEVICE_ARG]
                args[_EVENT_SYNC_ARG] = False
                return rebuild, tuple(args)
            return rebuild, args
        if isinstance(obj, torch.storage.TypedStorage):
            return reductions.reduce_typed_storage(obj)
        if isinstance(obj, torch.UntypedStorage):
            return _reduce_storage_by_name(obj)
        return NotImplemented


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple:
    """torch's file_system sharing of a CPU storage, whatever the process-wide sharing strategy is."""
    if storage.device.type != "cpu":
        raise ValueError(f"cannot share a {storage.device} storage by name; only CPU storages travel this way")
    manager, handle, size = storage._share_filename_cpu_()  # noqa: SLF001 - torch's own sharing call
    storage._shared_incref()  # noqa: SLF001 - the receiver's rebuild takes this reference
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def serialize_named_tensors(named: list[NamedTensor]) -> str:
    """`[(name, tensor), ...]` as one entry of SGLang's `serialized_named_tensors` (base64 of the pickle)."""
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()


class PackedBucket:
    """One bucket packed into a fresh flat buffer on the tensors' device; `payload` is SGLang's string for it.
    Call `release()` once the engine answered."""

    def __init__(self, bucket: list[NamedTensor]) -> None:
        if not bucket:
            raise ValueError("pack() got an empty bucket")
        device = bucket[0][1].device
        if any(t.device != device for _, t in bucket):
            raise ValueError(
                f"a colocated bucket mixes devices {sorted({str(t.device) for _, t in bucket})}; "
                "the trainer must hand over every tensor from its own GPU"
            )
        entries, total = pack_layout(bucket)
        total = -(-total // 16) * 16  # whole elements of every dtype, so each view's storage is well formed
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            # into torch's shared memory before the copies, so the bytes are written once
            flat.untyped_storage()._share_filename_cpu_()  # noqa: SLF001
        views = []
        for e, (name, t) in zip(entries, bucket, strict=True):
            raw = flat[e["offset"] : e["offset"] + tensor_nbytes(t)]
            raw.copy_(_as_bytes(t))
            views.append((name, raw.view(t.dtype).view(t.shape)))
        if device.type == "cuda":
            # The engine reads without waiting on an event: every byte is in place before the handle leaves.
            torch.cuda.current_stream(device).synchronize()
        self.flat: torch.Tensor | None = flat
        self.payload = serialize_named_tensors(views)

    def release(self) -> None:
        # Freed now if the engine dropped its mapping (it does so before answering); otherwise torch
        # keeps the memory until the engine's reference goes.
        self.flat = None


def pack(bucket: list[NamedTensor]) -> PackedBucket:
    """Pack one bucket for the engine on the same device; call `.release()` once the engine answered."""
    return PackedBucket(bucket)


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
        "handle": b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_counter_handle": b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": b64(event_handle),
    }


def _device_uuid(index: int) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


# -- engine side --------------------------------------------------------------------------------


def _rebuild_cuda_by_uuid(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor with the device given by UUID (or index), as SGLang's patched one."""
    args = list(args)
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        args[_DEVICE_ARG] = local_cuda_index(device, -1)
    return rebuild_cuda_tensor(*args)


def _rebuild_storage_by_name(cls: type, manager: bytes, handle: bytes, size: int, dtype: Any = None) -> Any:
    shm_path(os.fsdecode(handle))  # a plain segment name directly under /dev/shm, nothing else
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_by_name,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_by_uuid,
    # what SGLang's own serializer writes once its reductions are patched (the device as a UUID)
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_by_uuid,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and name in _DTYPES:
            found = getattr(torch, name)
        if found is None:
            raise ValueError(
                f"update_weights_from_tensor payload refers to {module}.{name}, which is not a tensor rebuild; "
                "send [(name, tensor), ...] serialised as SGLang's MultiprocessingSerializer does"
            )
        return found


def deserialize_named_tensors(entry: str | bytes) -> list[NamedTensor]:
    """One entry of `serialized_named_tensors` back to `[(name, tensor), ...]` (views of the sender's memory)."""
    try:
        raw = base64.b64decode(entry, validate=True) if isinstance(entry, str) else bytes(entry)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not base64: {exc}") from exc
    try:
        named = _TensorUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError) as exc:
        raise ValueError(f"serialized_named_tensors entry does not unpickle: {type(exc).__name__}: {exc}") from exc
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("serialized_named_tensors entry is not a list of (name, tensor) pairs (load_format null)")
    return named


@contextmanager
def open_payload(entry: str | bytes) -> Iterator[list[NamedTensor]]:
    """Map one payload entry to (name, tensor) views of the trainer's memory, valid inside the block only."""
    named = deserialize_named_tensors(entry)
    try:
        yield named
    finally:
        # The last references to the mapping go here: for CUDA torch syncs this device's current stream,
        # decrements the trainer's reference counter and closes the IPC handle.
        named.clear()


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
        unb64(b["handle"]),
        b["storage_bytes"],
        b["storage_offset"],
        False,
        unb64(b["ref_counter_handle"]),
        b["ref_counter_offset"],
        unb64(b["event_handle"]),
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
