"""Colocated handoff: trainer and engine share a device, so tensors change hands without a network.

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

Engines of several GPUs (`--rollout-num-gpus-per-engine` k > 1): engine i shares the GPUs of
trainer ranks `k*i .. k*i+k-1` (miles/controller/placement.py), and TP rank r of the engine maps
the buffer of trainer rank `k*i + r`. Every rank packs the bucket on its own GPU, the ranks
exchange their payloads (`all_gather`), and the engine's first rank posts the k strings in
TP-rank order; every rank keeps its buffer until the engine answered (a trainer barrier).

CUDA lifetime: torch counts the engine's mapping in a shared reference counter, so the trainer's
buffer is freed only after the engine dropped its mapping, even if the trainer lets go first.
The engine copies, synchronises its device and drops the mapping before it answers.
The engine side (`open_payload`) unpickles with an allow-list of exactly the globals this
format uses (torch's tensor and storage rebuild functions, torch types and dtypes), and names a
shared-memory file only directly under /dev/shm.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing import reductions
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from miles.weights.base import EngineCallError, EngineUnsupportedError, WeightUpdater, group_layout
from miles.weights.bucket import NamedTensor, tensor_nbytes
from miles.weights.groups import dtype_name

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary of the flat buffer (aligned, vectorised copies)
_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor arguments (SGLang's patch uses it too)
_EVENT_SYNC_ARG = 14  # index of event_sync_required


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
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
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


def colocated_layout(engine_gpus: list[int]) -> dict[int, tuple[int, int]]:
    """Trainer rank -> (engine, TP rank of the engine) it hands its buckets to: engine i of k GPUs runs on the
    GPUs of trainer ranks sum(k of engines before i) onwards (miles/controller/placement.py)."""
    _, offsets = group_layout(engine_gpus, first_rank=0)
    return {off + r: (i, r) for i, off in enumerate(offsets) for r in range(engine_gpus[i])}


class ColocatedUpdater(WeightUpdater):
    """Hands each bucket to the engine on the same device. Engine i of k GPUs is served by trainer ranks
    `offset_i .. offset_i + k - 1` (offset_i: the GPUs of engines 0..i-1), one per TP rank of the engine."""

    mode = "colocated"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.serves: dict[int, tuple[int, int]] = {}  # trainer rank -> (engine, the engine's TP rank)
        self.gpus: dict[int, int] = {}  # engine -> GPUs (TP ranks)

    @property
    def is_sender(self) -> bool:
        return self.trainer_rank in self.serves

    @property
    def exchanges(self) -> bool:
        """Whether an engine spans several trainer ranks (their payloads meet at the engine's first rank)."""
        return any(k > 1 for k in self.gpus.values())

    def _connect(self, master_address: str, master_port: int | None) -> None:
        self.gpus = self.engine_gpus()
        gpus = [self.gpus[i] for i in range(len(self.engines))]
        if sum(gpus) > self.trainer_world_size:
            raise EngineUnsupportedError(
                f"--colocate: the engines hold {sum(gpus)} GPUs ({gpus}) but the trainer has "
                f"{self.trainer_world_size} ranks; an engine's TP ranks share the trainer ranks' GPUs"
            )
        self.serves = colocated_layout(gpus)
        if self.exchanges and self.trainer_world_size > 1 and self._all_gather is None:
            raise ValueError(
                "colocated engines of several GPUs need the trainer ranks' all_gather; "
                "pass connect(..., all_gather=<trainer all_gather>)"
            )

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender and not self.exchanges:
            for _ in named:
                pass
            return {}
        pack_s = 0.0

        def start(bucket: list[NamedTensor]) -> Callable[[], None]:
            nonlocal pack_s
            t0 = time.perf_counter()
            packed = pack(bucket) if self.is_sender else None
            pack_s += time.perf_counter() - t0
            try:
                fut = self._post_bucket(packed, version)
            except BaseException:
                if packed is not None:
                    packed.release()
                raise

            def finish() -> None:
                try:
                    self._finish_bucket(fut)
                finally:
                    if packed is not None:
                        packed.release()

            return finish

        buckets = self._send_buckets(named, start)
        # pack_seconds: the trainer's share (copies into the flat buffers, waited for, and the IPC handles)
        return {"weight_sync/buckets": float(buckets), "weight_sync/pack_seconds": pack_s}

    def _post_bucket(self, packed: PackedBucket | None, version: int) -> Any:
        """Post this rank's bucket (with its engine's other TP ranks' payloads) if it leads its engine."""
        payloads = {self.trainer_rank: packed.payload if packed else None}
        if self.exchanges and self._all_gather is not None:
            payloads = dict(enumerate(self._all_gather(payloads[self.trainer_rank])))
        if not self.is_sender:
            return None
        engine, tp_rank = self.serves[self.trainer_rank]
        if tp_rank != 0:
            return None
        entries = [payloads[self.trainer_rank + r] for r in range(self.gpus[engine])]
        return self._start_engines(
            "update_weights_from_tensor",
            lambda i: {
                "serialized_named_tensors": entries,
                "weight_version": str(version),
                "flush_cache": False,
            },
            [engine],
        )

    def _finish_bucket(self, fut: Any) -> None:
        """Wait for the engine's answer; with engines of several GPUs every rank learns whether it came."""
        error: Exception | None = None
        if fut is not None:
            try:
                self._wait_engines(fut, "update_weights_from_tensor")
            except Exception as exc:  # noqa: BLE001 - shared with the other ranks first, then raised
                error = exc
        if self.exchanges and self._all_gather is not None:
            failed = [e for e in self._all_gather(None if error is None else str(error)) if e is not None]
            if failed and error is None:
                raise EngineCallError(
                    f"update_weights_from_tensor failed on another trainer rank's engine: {failed[0]}"
                )
        if error is not None:
            raise error

    def _close(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # buffers whose engine answered late (after a timeout) are freed here
