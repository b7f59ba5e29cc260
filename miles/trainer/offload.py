"""Move trainer state to host memory and back, bit-exactly, without changing tensor identity.

Offload copies each tensor *storage* to a host buffer (pinned when CUDA is present) and then
shrinks the device storage to zero bytes; onload grows it back and copies the bytes in. Because
the storages themselves are kept, every alias stays valid: FSDP's sharded parameters (views into
padded shard buffers), the optimizer's references to them, and gradients. Nothing is re-created,
so no optimizer or FSDP re-registration is needed.

The host buffers are allocated (and pinned) once and reused by every later offload of the same
storages: pinning is a slow page-locking call, while copies to and from pinned memory run at the
bus's bandwidth.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

from miles.trainer.offload_optim import pin_host

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor -> its local shard; plain tensors as they are.
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    if hasattr(optimizer, "device_tensors"):  # an optimizer keeping its state off the device says what is on it
        yield from optimizer.device_tensors()
        return
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def module_tensors(module: torch.nn.Module, *, grads: bool = True) -> Iterator[torch.Tensor]:
    for p in module.parameters():
        yield p
        if grads and p.grad is not None:
            yield p.grad
    yield from module.buffers()


@contextlib.contextmanager
def module_onloaded(
    off: HostOffloader | DiskOffloader | None,
    module: torch.nn.Module | None,
    before_offload: Callable[[], None] | None = None,
) -> Iterator[None]:
    """An offloaded frozen `module` (the reference model) on the device for the body and back off it after;
    with no offloader, just the body. `before_offload` runs first on the way out (FSDP reshards there)."""
    if off is None or module is None:
        yield
        return
    off.onload()
    try:
        yield
    finally:
        if before_offload is not None:
            before_offload()
        off.offload(module_tensors(module))


class HostOffloader:
    """Offload/onload a set of tensors by storage. One instance per offloadable component."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._host: list[torch.Tensor] = []  # byte buffers kept between offloads, in storage order

    @property
    def is_offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of `tensors` to host and free them on the device; returns bytes moved."""
        if self._saved:
            raise RuntimeError(f"{self.name}: offload() called twice without onload()")
        pin = torch.cuda.is_available()
        seen: set[int] = set()
        moved = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            if not storage.resizable():
                raise RuntimeError(
                    f"{self.name}: cannot offload a tensor of shape {tuple(t.shape)} dtype {t.dtype} "
                    f"({type(t).__name__}): its storage is not resizable"
                )
            host = self._host_buffer(len(self._saved), storage.nbytes(), pin)
            host.copy_(storage, non_blocking=pin)
            self._saved.append((storage, host))
            moved += storage.nbytes()
        if pin:
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        logger.info("%s: offloaded %.1f MiB to host", self.name, moved / 2**20)
        return moved

    def _host_buffer(self, i: int, nbytes: int, pin: bool) -> torch.UntypedStorage:
        """The i-th host buffer, page-locked in place when `pin` (exactly `nbytes`: pin_memory() would copy
        into the pinned pool, which rounds each buffer up to a power of two, up to twice the host memory)."""
        if i < len(self._host) and self._host[i].nbytes == nbytes:
            return self._host[i].untyped_storage()
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            host = pin_host(host)  # the tensor is kept: it unlocks the memory when it goes
        self._host[i:] = [host]  # storages changed from here on: later buffers are allocated anew
        return host.untyped_storage()

    def onload(self) -> int:
        """Restore every offloaded storage in place; returns bytes moved."""
        moved = 0
        pin = torch.cuda.is_available()
        for storage, host in self._saved:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=pin)
            moved += host.nbytes()
        if pin:
            torch.cuda.synchronize()
        self._saved.clear()
        logger.info("%s: onloaded %.1f MiB", self.name, moved / 2**20)
        return moved


class DiskOffloader:
    """`HostOffloader` with the bytes in files under a directory (`--offload-train-target disk`).

    Each storage goes to its own file, in chunks of `chunk_bytes` through one staging buffer (page-locked
    on CUDA); onload reads it back into the same storage. Bit-exact, like
    the host version, and the tensors keep their identity.
    """

    def __init__(self, name: str, directory: str, chunk_bytes: int) -> None:
        import tempfile

        os.makedirs(directory, exist_ok=True)
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"{name}-", dir=directory)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.chunk_bytes = chunk_bytes
        self._saved: list[tuple[torch.UntypedStorage, str, int]] = []
        self._staging: torch.Tensor | None = None

    @property
    def is_offloaded(self) -> bool:
        return bool(self._saved)

    def _stage(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Write the storages of `tensors` to files and free them; returns bytes moved."""
        if self._saved:
            raise RuntimeError(f"{self.name}: offload() called twice without onload()")
        seen: set[int] = set()
        moved = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            path = os.path.join(self.dir, f"{len(self._saved)}.bin")
            self._write(storage, path)
            self._saved.append((storage, path, storage.nbytes()))
            moved += storage.nbytes()
        for storage, _, _ in self._saved:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("%s: offloaded %.1f MiB to %s", self.name, moved / 2**20, self.dir)
        return moved

    def _write(self, storage: torch.UntypedStorage, path: str) -> None:
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        with open(path, "wb") as f:
            for a in range(0, src.numel(), self.chunk_bytes):
                part = src[a : a + self.chunk_bytes]
                # through the staging buffer on CPU too: numpy() of the storage itself would make it unresizable
                f.write(self._stage()[: part.numel()].copy_(part).numpy().tobytes())

    def onload(self) -> int:
        """Read every offloaded storage back in place; returns bytes moved."""
        moved = 0
        for storage, path, nbytes in self._saved:
            storage.resize_(nbytes)
            dst = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            with open(path, "rb") as f:
                for a in range(0, nbytes, self.chunk_bytes):
                    n = min(self.chunk_bytes, nbytes - a)
                    host = self._stage()[:n]
                    f.readinto(memoryview(host.numpy()))
                    dst[a : a + n].copy_(host)
            os.remove(path)
            moved += nbytes
        self._saved.clear()
        logger.info("%s: onloaded %.1f MiB from %s", self.name, moved / 2**20, self.dir)
        return moved
