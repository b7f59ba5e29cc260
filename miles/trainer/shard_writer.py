"""Checkpoint shards serialized by a process of their own, so that writing them never holds the trainer's GIL.

`torch.save` (what DCP's file writer calls for every tensor) computes its zip records' CRC-32 and copies the
bytes with the GIL held. Run in a thread of the training process, as an asynchronous save's writer was, it
stalls the training loop's own Python for much of the write: a thread writing 1.5 GB slowed a loop of small
torch calls by 17-38% on two cores, where plain `file.write` of the same bytes slowed it by nothing, and a
1.5B-shape GRPO step took 18-19% longer with a save in flight on the H200.

So an asynchronous save's snapshot lives in one `SnapshotArena`: a page-locked buffer of shared memory
(`memfd`), laid out once per state layout and reused by every save. A `ShardWriterProcess` maps the same
memory and writes the shard files with `torch.save`, byte for byte what DCP's own writer writes, so
`dcp.load` reads them as any other checkpoint. `ShardFileWriter` is the DCP storage writer that hands it the
work: the plan, the collectives and the metadata stay with DCP in the trainer; only the serialization moves.
Tensors outside the arena (host state a lever keeps off the device, which the snapshot references) and
non-contiguous ones are written in the calling thread as before, into a second file.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every view starts on a cache line (and on its element size)
Key = tuple
Layout = list[tuple[Key, tuple[int, ...], torch.dtype]]


class SnapshotArena:
    """One shared, page-locked host buffer holding a snapshot; `views[key]` is the tensor for `key`."""

    def __init__(self, layout: Layout) -> None:
        from miles.trainer.offload_optim import pin_host

        self.layout = layout
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            total += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.nbytes = max(total, _ALIGN)
        self.fd = os.memfd_create("miles-checkpoint-snapshot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes)
        self.bytes = pin_host(torch.frombuffer(self._map, dtype=torch.uint8))
        self.views = {
            key: self.bytes[off : off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for (key, shape, dtype), off in zip(layout, offsets, strict=True)
        }

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(byte offset, byte length) of `t` in the arena, or None where it is not a contiguous part of it."""
        base = self.bytes.data_ptr()
        start = t.data_ptr() - base if t.device.type == "cpu" else -1
        if not t.is_contiguous() or start < 0 or start + t.nbytes > self.nbytes:
            return None
        return start, t.nbytes

    def close(self) -> None:
        os.close(self.fd)


class ShardWriterProcess:
    """`python -m miles.trainer.shard_writer`, mapping one arena; `write()` has it write one shard file."""

    def __init__(self, arena: SnapshotArena) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles.trainer.shard_writer",
                str(theirs.fileno()),
                str(arena.fd),
                str(arena.nbytes),
            ],
            pass_fds=(theirs.fileno(), arena.fd),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())

    def write(self, path: str, items: list[tuple[int, Any]], sync: bool) -> list[tuple[int, int, int]]:
        """items: (index, bytes | (offset, nbytes, dtype name, shape)); returns (index, offset, length) each."""
        try:
            self._conn.send(("write", path, items, sync))
            status, reply = self._conn.recv()
        except (EOFError, OSError) as e:
            raise OSError(f"the checkpoint shard writer (pid {self._proc.pid}) is gone: {e}") from e
        if status != "ok":
            raise OSError(f"writing {path} failed in the shard writer: {reply}")
        return reply

    def close(self) -> None:
        self._conn.close()  # it exits at the end of its input
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ShardFileWriter(FileSystemWriter):
    """DCP's file writer with the arena's tensors (and the small byte items) serialized by `process`."""

    def __init__(self, path: str, arena: SnapshotArena, process: ShardWriterProcess) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.arena, self.process = arena, process

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        remote, local = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                remote.append((item, data.getvalue()))
                continue
            where = self.arena.locate(data)
            if where is None:
                local.append((item, data))
            else:
                remote.append((item, (*where, str(data.dtype).removeprefix("torch."), tuple(data.shape))))
        prefix = plan.storage_data.prefix
        results = []
        name = f"{prefix}0{DEFAULT_SUFFIX}"
        written = self.process.write(
            str(self.fs.concat_path(self.path, name)), [(i, payload) for i, (_, payload) in enumerate(remote)], True
        )
        for (item, _), (_, offset, length) in zip(remote, written, strict=True):
            results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
        if local:
            name = f"{prefix}1{DEFAULT_SUFFIX}"
            spans = _write_file(str(self.fs.concat_path(self.path, name)), [t for _, t in local], sync=True)
            for (item, _), (offset, length) in zip(local, spans, strict=True):
                results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _write_file(path: str, values: list[bytes | torch.Tensor], sync: bool) -> list[tuple[int, int]]:
    """Each value as DCP's file writer writes it (bytes as they are, a tensor through torch.save, a view
    cloned so that only its own elements are written); returns (offset, length) of each."""
    spans = []
    with open(path, "wb") as f:
        for v in values:
            offset = f.tell()
            if isinstance(v, bytes):
                f.write(v)
            else:
                t = v.detach()
                if t.untyped_storage().nbytes() != t.nbytes:
                    t = t.clone()
                torch.save(t, f)
            spans.append((offset, f.tell() - offset))
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return spans


def _serve(conn: Connection, memory: memoryview) -> None:
    while True:
        try:
            _, path, items, sync = conn.recv()
        except EOFError:  # the trainer closed its end, or is gone
            return
        try:
            values = []
            for _, payload in items:
                if isinstance(payload, bytes):
                    values.append(payload)
                    continue
                offset, nbytes, dtype, shape = payload
                dt = getattr(torch, dtype)
                t = (
                    torch.frombuffer(memory[offset : offset + nbytes], dtype=dt)
                    if nbytes
                    else torch.empty(0, dtype=dt)
                )
                values.append(t.view(shape))
            spans = _write_file(path, values, sync)
            conn.send(("ok", [(i, *span) for (i, _), span in zip(items, spans, strict=True)]))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it as the save's failure
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


def main(argv: list[str]) -> None:
    conn_fd, mem_fd, nbytes = (int(a) for a in argv)
    _serve(Connection(conn_fd), memoryview(mmap.mmap(mem_fd, nbytes)))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (KeyboardInterrupt, pickle.UnpicklingError):
        pass
