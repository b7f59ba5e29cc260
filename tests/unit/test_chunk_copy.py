"""The chunked copy kernel of the direct colocated update, against the bytes it must move.

On CUDA the checks run on the GPU; elsewhere `test_under_interpreter` re-runs this file in a child
process with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from miles.weights import chunk_copy  # noqa: E402
from miles.weights.chunk_copy import CHUNK_WORDS, ChunkCopier  # noqa: E402
from miles.weights.colocated_direct import BufferWriter  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = DEVICE.type == "cuda" or chunk_copy.INTERPRET
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")


@pytest.mark.skipif(RUNS_HERE, reason="the checks run directly here")
def test_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed, 1 skipped", summary), summary


@needs_kernel
def test_chunks_of_many_tensors_land_at_their_offsets():
    gen = torch.Generator().manual_seed(0)
    # sizes in bytes: one chunk exactly, several chunks plus a tail, tiny ones; mixed dtypes
    sources = [
        torch.randint(0, 2**15, (CHUNK_WORDS * 2,), generator=gen, dtype=torch.int16),
        torch.randn(CHUNK_WORDS * 2 + 100, generator=gen),
        torch.randn(8, generator=gen).to(torch.bfloat16),
        torch.randn(3, 4, generator=gen),
    ]
    sources = [s.to(DEVICE) for s in sources]
    sources.insert(0, sources[1][CHUNK_WORDS:].clone())  # the base source need not be the lowest address
    sizes = [s.numel() * s.element_size() for s in sources]
    offsets, pos = [], 256
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // 256) * 256 + 256
    flat = torch.zeros(pos, dtype=torch.uint8, device=DEVICE)
    copier = ChunkCopier(flat, first_flush_bytes=CHUNK_WORDS * 4)  # several launches
    for round_ in range(2):  # the second round reuses the staging tables
        sources = [s + 1 for s in sources] if round_ else sources
        for src, off, n in zip(sources, offsets, sizes, strict=True):
            assert copier.takes(src)
            copier.add(src, off, n)
        copier.finish()
        expected = torch.zeros_like(flat)
        for src, off, n in zip(sources, offsets, sizes, strict=True):
            expected[off : off + n] = src.reshape(-1).view(torch.uint8)
        assert torch.equal(flat.cpu(), expected.cpu())
    assert copier.launches >= 4


@needs_kernel
def test_unaligned_sources_and_slots_are_left_to_the_caller():
    flat = torch.zeros(1024, dtype=torch.uint8, device=DEVICE)
    copier = ChunkCopier(flat)
    base = torch.zeros(64, dtype=torch.float32, device=DEVICE)
    assert not copier.takes(base[1:5])  # 4 bytes past a 16-byte boundary
    assert not copier.takes(base.view(8, 8).t())  # not contiguous
    assert copier.slot_offset(flat[16:48]) == 16
    assert copier.slot_offset(flat[16:46]) is None  # 30 bytes: not a multiple of 16
    assert copier.slot_offset(flat[8:40]) is None  # unaligned destination


@needs_kernel
def test_buffer_writer_uses_the_kernel_and_copies_the_rest_itself():
    export = {
        "tensors": {
            "w": {"offset": 0, "shape": [64, 96], "stride": [96, 1], "dtype": "float32"},
            "b": {"offset": 24576, "shape": [7], "stride": [1], "dtype": "bfloat16"},  # 14 bytes: no kernel
            "t": {"offset": 24832, "shape": [4, 6], "stride": [1, 4], "dtype": "float32"},  # strided view
        },
    }
    flat = torch.zeros(25088, dtype=torch.uint8, device=DEVICE)
    writer = BufferWriter(flat, export)
    assert writer._copier is not None
    new = {
        "w": torch.randn(64, 96, device=DEVICE),
        "b": torch.randn(7, device=DEVICE).to(torch.bfloat16),
        "t": torch.randn(4, 6, device=DEVICE),
    }
    writer.write(new.items())
    assert writer._copier.launches == 1
    for name, t in new.items():
        assert torch.equal(writer.view(name).cpu(), t.cpu()), name
