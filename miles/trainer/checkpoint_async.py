"""Asynchronous checkpoint saves (`--async-save`, the FSDP default): `BackgroundWriter`.

`save_checkpoint(..., background=writer)` (`checkpoint.py`) has the writer snapshot the state to host
memory (every tensor on the training device is copied, on CUDA by copies queued on a stream of their own
that the next optimizer step or offload waits for on the GPU; state that already lives on the host, such
as an offloaded optimizer's moments, is referenced and the next optimizer step waits for the write),
writes meta.json and the RNG files, and returns; a thread then writes the DCP shards over a gloo group
of its own and, once every rank's shards are durable, rank 0 writes COMPLETE. On CUDA the snapshot lives in
shared memory and a process of its own serializes the shards (`shard_writer.py`), so that the write never
holds the training loop's GIL. At most one save is in
flight: the next save (and a load, and the end of the run) first waits for it, and a failure of the
background write is raised there, on every rank, as CheckpointWriteError.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from miles.trainer.checkpoint_commit import raise_first, write_error, write_marker
from miles.trainer.shard_writer import ShardFileWriter, ShardWriterProcess, SnapshotArena

logger = logging.getLogger(__name__)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackgroundWriter:
    """Writes one checkpoint's DCP shards at a time in a thread, then its COMPLETE marker (see the module doc)."""

    def __init__(self, device: torch.device, shard_process: bool | None = None) -> None:
        self.device = device
        self._group = None  # gloo, created at the first save (collective): the thread's collectives use it
        self._host: dict[tuple, torch.Tensor] = {}  # snapshot buffers, reused by every save
        # CUDA (or when asked): the snapshot in one shared arena whose shards a process of their own serializes,
        # so that writing never holds this process's GIL (shard_writer.py); else they are written in the thread
        self.shard_process = device.type == "cuda" if shard_process is None else shard_process
        self._arena: SnapshotArena | None = None
        self._writer_process: ShardWriterProcess | None = None
        self._thread: threading.Thread | None = None
        self._path: str | None = None
        self._error: str | None = None
        self._staged: dict[str, Any] | None = None
        self.references_live_state = False  # the snapshot points at host state the next optimizer step changes
        # CUDA: the snapshot's copies run on a stream of their own, after the work queued so far, and the
        # event marks their end; the next change to the state waits for it on the GPU (`fence`), the writer
        # thread on the host
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None

    @property
    def pending(self) -> str | None:
        return self._path

    def ensure_group(self) -> None:
        """Collective (every rank, before anything of the save can fail): the writer threads' gloo group."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")

    def stage(self, path: str, state: dict[str, Any]) -> None:
        """Snapshot `state` to host memory for the checkpoint at `path`; `launch()` starts writing it.

        On CUDA the copies are queued, not waited for: whatever next changes or frees the state must first
        call `fence()` (the backend does before an optimizer step and an offload)."""
        if self._thread is not None:
            raise RuntimeError(f"a checkpoint is still being written ({self._path}); call wait() first")
        self.references_live_state = False
        if self.shard_process:
            self._use_arena(state)
        if self._copy_stream is None:
            self._staged = self._snapshot(state, ())
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the state as of now
            with torch.cuda.stream(self._copy_stream):
                self._staged = self._snapshot(state, ())
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        self._path, self._error = path, None

    def fence(self) -> None:
        """Work queued after this on the current stream (an optimizer step, an offload that frees the
        weights) runs after the snapshot's copies; the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    def _use_arena(self, state: dict[str, Any]) -> None:
        """The snapshot's buffers are the arena's views, laid out anew (with its writer process) when the
        state's layout changes; where no arena can be made, shards are written in the thread."""
        layout = list(self._device_tensors(state, ()))
        if self._arena is not None and self._arena.layout == layout:
            return
        self.close()
        try:
            self._arena = SnapshotArena(layout)
            self._writer_process = ShardWriterProcess(self._arena)
        except OSError as e:
            logger.warning("checkpoint shards are written in a thread of the trainer (no shared snapshot: %s)", e)
            self.shard_process, self._arena = False, None
            return
        self._host = dict(self._arena.views)

    def _device_tensors(self, value: Any, key: tuple):
        """(key, shape, dtype) of every tensor of `value` on the training device, in `_snapshot`'s order."""
        if isinstance(value, dict):
            for k, v in value.items():
                yield from self._device_tensors(v, (*key, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from self._device_tensors(v, (*key, i))
        elif isinstance(value, torch.Tensor):
            local = value._local_tensor if isinstance(value, DTensor) else value
            if local.device == self.device:
                yield key, tuple(local.shape), local.dtype

    def close(self) -> None:
        """Stop the shard writer process and free the arena (a save in flight is waited for first)."""
        self.wait_local()
        if self._writer_process is not None:
            self._writer_process.close()
        if self._arena is not None:
            self._arena.close()
        self._writer_process = self._arena = None
        self._host = {}

    def launch(self) -> None:
        snapshot, self._staged = self._staged, None
        self._thread = threading.Thread(target=self._write, args=(self._path, snapshot), name="checkpoint-writer")
        self._thread.start()

    def _snapshot(self, value: Any, key: tuple) -> Any:
        if isinstance(value, dict):
            return {k: self._snapshot(v, (*key, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._snapshot(v, (*key, i)) for i, v in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value
        local = value._local_tensor if isinstance(value, DTensor) else value
        if local.device != self.device:
            self.references_live_state = True
            return value
        host = self._host.get(key)
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            from miles.trainer.offload_optim import pin_host

            host = self._host[key] = pin_host(torch.empty(local.shape, dtype=local.dtype))
        if self._copy_stream is not None:
            local.record_stream(self._copy_stream)  # a temporary of the state dict is not reused before the copy
        host.copy_(local.detach(), non_blocking=True)
        if isinstance(value, DTensor):  # DTensor.from_local would copy the host tensor back to the mesh's device
            return DTensor(host, value._spec, requires_grad=False)
        return host

    def _write(self, path: str, snapshot: dict[str, Any]) -> None:
        try:
            if self._copied is not None:
                self._copied.synchronize()  # the snapshot's copies are in host memory
            rank = dist.get_rank()
            _fsync(os.path.join(path, "rng", f"rank_{rank}.pt"))  # durable before DCP's last step, hence the marker
            model_dir = os.path.join(path, "model")
            if self._writer_process is not None:  # fsyncs its files, as DCP's own writer does
                writer = ShardFileWriter(model_dir, self._arena, self._writer_process)
                dcp.save(snapshot, storage_writer=writer, process_group=self._group)
            else:
                dcp.save(snapshot, checkpoint_id=model_dir, process_group=self._group)  # fsyncs its files
            if rank == 0:  # every rank's shards are written (DCP's last step gathers them)
                _fsync(os.path.join(path, "meta.json"))
                write_marker(path)
            logger.info("saved checkpoint %s", path)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; wait() raises it
            logger.exception("writing checkpoint %s failed", path)
            self._error = write_error(path, e)

    def wait_local(self) -> None:
        """This rank's write is finished (no collective; a failure is raised by the next wait())."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Collective: the checkpoint in flight is complete on every rank, or all raise its failure."""
        if self._thread is None:  # saves are collective: no rank has one in flight either
            return
        self.wait_local()
        path, error = self._path, self._error
        self._thread = self._path = self._error = self._copied = None
        raise_first(path, error)
