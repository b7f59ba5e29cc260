"""Many device-to-device copies in one kernel launch: the direct colocated update's copies.

`copy_` costs the host several microseconds per tensor and each copy ramps up and drains on its own
on the GPU; a model of a few hundred tensors then spends more time issuing copies than copying.
`ChunkCopier` only collects (source tensor, destination byte offset) pairs and hands every 64 KiB
chunk of every pending tensor to one program of a Triton kernel. The first launch of a round goes
out after 64 MiB (so the GPU starts while the host is still collecting), each later one after twice
as much as the one before (a launch costs the host about as long as the GPU takes for 256 MiB);
`finish()` launches the rest and ends the round (an update).

The kernel moves 4-byte words with 16-byte vector accesses: a source qualifies when it is
contiguous, starts on a 16-byte boundary and is a multiple of 16 bytes long, and its destination
offset is 16-byte aligned. Callers copy anything else themselves (`ChunkCopier.takes`).

Source addresses travel as word offsets from the first pending source (signed: the other sources
may sit below it), destination addresses as word offsets into the flat destination buffer. The
copier holds a reference to every pending source until the launch: the caching allocator may reuse
a tensor's memory as soon as its last reference goes, and only a launch orders that reuse after the copy.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:  # triton ships with CUDA builds of torch; CPU installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

CHUNK_WORDS = 65536  # 256 KiB of 4-byte words per program
BLOCK_WORDS = 4096  # words moved per loop iteration of a program
NUM_WARPS = 8
FIRST_FLUSH_BYTES = 64 << 20  # the first launch of a round, so the GPU starts early ...
MAX_FLUSH_BYTES = 1 << 30  # ... then each launch takes twice as much (a launch costs the host ~0.1 ms)
ALIGN = 16

if triton is not None:

    @triton.jit
    def _chunk_copy_kernel(src_base, dst_base, table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program p copies table[p, 2] words from src_base + table[p, 0] to dst_base + table[p, 1]
        (all multiples of 4 words)."""
        p = tl.program_id(0).to(tl.int64)
        src_off = tl.multiple_of(tl.load(table_ptr + 3 * p), 4)
        dst_off = tl.multiple_of(tl.load(table_ptr + 3 * p + 1), 4)
        count = tl.multiple_of(tl.load(table_ptr + 3 * p + 2), 4)
        for start in range(0, CHUNK, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < count
            words = tl.load(src_base + src_off + idx, mask=mask)
            tl.store(dst_base + dst_off + idx, words, mask=mask)


def usable(flat: torch.Tensor) -> bool:
    """Whether the kernel can copy into `flat` (a CUDA buffer, or any under Triton's interpreter)."""
    return triton is not None and (flat.is_cuda or INTERPRET) and flat.data_ptr() % ALIGN == 0


class _Staging:
    """The chunk tables of one round of copies (one update) on one device: rows [0, used) are taken.

    Staged in pinned memory and kept for the process (every update, every mapping): a copy from
    pageable memory waits for the kernels already queued, and a pinned allocation per launch
    synchronises as well. Row-major [rows, 3] so that a launch's rows are one contiguous block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.used = 0
        self.done: torch.cuda.Event | None = None  # the previous round's table copies are done

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n free rows of the host table and the matching device rows."""
        if self.used == 0 and self.done is not None:
            self.done.synchronize()  # the previous round's copies out of the host table are finished
            self.done = None
        if self.host is None or self.used + n > self.host.shape[0]:
            rows = max(2 * (self.host.shape[0] if self.host is not None else 0), n, 4096)
            cuda = self.device.type == "cuda"
            # launched kernels keep reading the old device table: the allocator orders its reuse after them
            self.host = torch.empty((rows, 3), dtype=torch.int64, pin_memory=cuda)
            self.dev = torch.empty((rows, 3), dtype=torch.int64, device=self.device) if cuda else self.host
            self.used = 0
        block = slice(self.used, self.used + n)
        self.used += n
        return self.host[block], self.dev[block]

    def end_round(self) -> None:
        if self.used and self.device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()
        self.used = 0


_STAGING: dict[torch.device, _Staging] = {}


class ChunkCopier:
    """Collects copies into the flat uint8 buffer `flat` and runs them as chunked kernel launches."""

    def __init__(
        self, flat: torch.Tensor, first_flush_bytes: int = FIRST_FLUSH_BYTES, max_flush_bytes: int = MAX_FLUSH_BYTES
    ) -> None:
        self.flat = flat
        self.words = flat[: flat.numel() // 4 * 4].view(torch.int32)
        self.first_flush_bytes, self.max_flush_bytes = first_flush_bytes, max_flush_bytes
        self.flush_bytes = first_flush_bytes
        self._sources: list[torch.Tensor] = []
        self._offsets: list[int] = []  # destination byte offsets
        self._sizes: list[int] = []
        self._pending = 0
        self.launches = 0
        self._staging = _STAGING.setdefault(flat.device, _Staging(flat.device))

    def slot_offset(self, dst: torch.Tensor) -> int | None:
        """The byte offset of destination view `dst` if the kernel can write it, else None."""
        offset = dst.data_ptr() - self.flat.data_ptr()
        nbytes = dst.numel() * dst.element_size()
        ok = dst.is_contiguous() and offset % ALIGN == 0 and nbytes % ALIGN == 0
        return offset if ok and 0 <= offset and offset + nbytes <= self.words.numel() * 4 else None

    @staticmethod
    def takes(src: torch.Tensor) -> bool:
        """Whether source `src` (same dtype, device and shape as its destination) qualifies."""
        return src.data_ptr() % ALIGN == 0 and src.is_contiguous()

    def add(self, src: torch.Tensor, dst_offset: int, nbytes: int) -> None:
        """Queue `src` (see `takes`) for bytes [dst_offset, dst_offset + nbytes) of the buffer (`slot_offset`)."""
        if nbytes == 0:
            return
        self._sources.append(src)
        self._offsets.append(dst_offset)
        self._sizes.append(nbytes)
        self._pending += nbytes
        if self._pending >= self.flush_bytes:
            self.flush()
            self.flush_bytes = min(2 * self.flush_bytes, self.max_flush_bytes)

    def finish(self) -> None:
        """Launch what is pending; the next `add` starts a new round (reusing the staging tables)."""
        self.flush()
        self._staging.end_round()
        self.flush_bytes = self.first_flush_bytes

    def flush(self) -> None:
        """Launch the pending copies on the current stream (no wait)."""
        if not self._sources:
            return
        sources, offsets, sizes = self._sources, self._offsets, self._sizes
        self._sources, self._offsets, self._sizes, self._pending = [], [], [], 0
        base = sources[0]
        base_words = base.reshape(-1).view(torch.uint8).view(torch.int32)
        src_words = (np.fromiter((t.data_ptr() for t in sources), np.int64, len(sources)) - base.data_ptr()) // 4
        dst_words = np.asarray(offsets, dtype=np.int64) // 4
        words = np.asarray(sizes, dtype=np.int64) // 4
        chunks = -(-words // CHUNK_WORDS)
        owner = np.repeat(np.arange(len(sources)), chunks)  # the tensor of every chunk
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)  # ... and where its chunks begin
        within = (np.arange(owner.size, dtype=np.int64) - first) * CHUNK_WORDS
        table_host, table_dev = self._staging.take(owner.size)
        table = table_host.numpy()
        np.add(src_words[owner], within, out=table[:, 0])
        np.add(dst_words[owner], within, out=table[:, 1])
        np.minimum(CHUNK_WORDS, words[owner] - within, out=table[:, 2])
        if table_dev.is_cuda:  # from the pinned allocation itself, so torch keeps it until the copy is done
            table_dev.copy_(table_host, non_blocking=True)
        _chunk_copy_kernel[(owner.size,)](
            base_words,
            self.words,
            table_dev,
            CHUNK=CHUNK_WORDS,
            BLOCK=BLOCK_WORDS,
            num_warps=NUM_WARPS,
        )
        self.launches += 1
        del sources  # launched: from here on the allocator orders any reuse after the kernel
