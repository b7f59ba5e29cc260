"""A fixed sequence of tensors copied into one flat buffer by two kernel launches.

A trainer hands over the same tensors (names, sizes, destinations) in the same order every update;
only their addresses change. `GatherCopy` therefore precomputes, once, a device table of 256 KiB
chunks (which tensor, where in it, how many words) and the destination of every tensor; an update
then costs the host one word offset per tensor, a small copy of those offsets to the device and a
kernel launch per part. torch's copies cost the host several microseconds per tensor, which on the
hosts measured kept the GPU waiting.

Two parts: the first holds about a tenth of the bytes, so the GPU starts while the host still
collects the second. Sources must be contiguous, 16-byte aligned and a multiple of 16 bytes long,
like their destinations (`eligible`); callers copy anything else themselves. Source addresses
travel as signed word offsets from the part's first source; the caller keeps every source alive
until its part is launched.
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
ALIGN = 16
CHUNK_WORDS = 65536  # 256 KiB of 4-byte words per program
BLOCK_WORDS = 4096
FIRST_PART = 0.1  # the first launch covers about this fraction of the bytes

if triton is not None:

    @triton.jit
    def _gather_copy_kernel(
        src_base, dst_base, chunks_ptr, src_off_ptr, dst_off_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Program p copies chunks[p, 2] words of tensor t = chunks[p, 0], from word chunks[p, 1] of it:
        src_base + src_off[t] + ... to dst_base + dst_off[t] + ... (every offset a multiple of 4 words)."""
        p = tl.program_id(0).to(tl.int64)
        t = tl.load(chunks_ptr + 3 * p)
        within = tl.multiple_of(tl.load(chunks_ptr + 3 * p + 1), 4)
        count = tl.multiple_of(tl.load(chunks_ptr + 3 * p + 2), 4)
        src = tl.multiple_of(tl.load(src_off_ptr + t), 4) + within
        dst = tl.multiple_of(tl.load(dst_off_ptr + t), 4) + within
        for start in range(0, CHUNK, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < count
            tl.store(dst_base + dst + idx, tl.load(src_base + src + idx, mask=mask), mask=mask)


def usable(flat: torch.Tensor) -> bool:
    """Whether the kernel can copy into `flat` (a CUDA buffer, or any under Triton's interpreter)."""
    return triton is not None and (flat.is_cuda or INTERPRET) and flat.data_ptr() % ALIGN == 0


def eligible(t: torch.Tensor) -> bool:
    """A source or destination the kernel can move: contiguous, 16-byte aligned, whole 16-byte units."""
    return t.data_ptr() % ALIGN == 0 and (t.numel() * t.element_size()) % ALIGN == 0 and t.is_contiguous()


class _Part:
    def __init__(self, device: torch.device, dst_words: np.ndarray, words: np.ndarray) -> None:
        chunks = -(-words // CHUNK_WORDS)
        owner = np.repeat(np.arange(words.size, dtype=np.int64), chunks)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        within = (np.arange(owner.size, dtype=np.int64) - first) * CHUNK_WORDS
        table = np.stack([owner, within, np.minimum(CHUNK_WORDS, words[owner] - within)], axis=1)
        self.size = words.size
        self.programs = owner.size
        self.chunks = torch.from_numpy(np.ascontiguousarray(table)).to(device)
        self.dst_off = torch.from_numpy(dst_words).to(device)
        cuda = device.type == "cuda"
        self.src_host = torch.empty(words.size, dtype=torch.int64, pin_memory=cuda)
        self.src_dev = torch.empty(words.size, dtype=torch.int64, device=device) if cuda else self.src_host


class GatherCopy:
    """Copies, in order, tensors of the given byte sizes to the given byte offsets of `flat`."""

    def __init__(self, flat: torch.Tensor, dst_offsets: list[int], sizes: list[int]) -> None:
        self.flat = flat
        self.words = flat[: flat.numel() // 4 * 4].view(torch.int32)
        dst_words = np.asarray(dst_offsets, dtype=np.int64) // 4
        words = np.asarray(sizes, dtype=np.int64) // 4
        cut = int(np.searchsorted(np.cumsum(words), FIRST_PART * words.sum())) + 1 if words.size > 1 else words.size
        self.bounds = [0, min(cut, words.size - 1), words.size] if words.size > 1 else [0, words.size]
        self.parts = [
            _Part(flat.device, dst_words[a:b], words[a:b]) for a, b in zip(self.bounds, self.bounds[1:], strict=False)
        ]
        self._staged: torch.cuda.Event | None = None  # the last update's offset copies are done
        self.launches = 0

    @property
    def part_ends(self) -> list[int]:
        """Tensor index after which each part is complete."""
        return self.bounds[1:]

    def launch(self, index: int, sources: list[torch.Tensor]) -> None:
        """Copy the sources of part `index` (in order, all `eligible`) on the current stream."""
        part = self.parts[index]
        if len(sources) != part.size:
            raise ValueError(f"part {index} copies {part.size} tensors, got {len(sources)}")
        if index == 0 and self._staged is not None:
            self._staged.synchronize()  # the previous update's copies out of the pinned offsets are done
            self._staged = None
        base = sources[0]
        offsets = part.src_host.numpy()
        offsets[:] = np.fromiter((t.data_ptr() for t in sources), np.int64, len(sources))
        offsets -= base.data_ptr()
        offsets //= 4
        if part.src_dev is not part.src_host:
            part.src_dev.copy_(part.src_host, non_blocking=True)
        _gather_copy_kernel[(part.programs,)](
            base.reshape(-1).view(torch.uint8).view(torch.int32),
            self.words,
            part.chunks,
            part.src_dev,
            part.dst_off,
            CHUNK=CHUNK_WORDS,
            BLOCK=BLOCK_WORDS,
            num_warps=8,
        )
        self.launches += 1
        if index == len(self.parts) - 1 and self.flat.is_cuda:
            self._staged = torch.cuda.Event()
            self._staged.record()
