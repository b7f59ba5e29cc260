"""The direct colocated update's gather copy (two kernel launches for a known sequence of tensors).

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

from miles.weights import gather_copy  # noqa: E402
from miles.weights.colocated_direct import BufferWriter  # noqa: E402
from miles.weights.gather_copy import CHUNK_WORDS  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = DEVICE.type == "cuda" or gather_copy.INTERPRET
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")

SHAPES = {  # name: (shape, dtype); one tensor spans several chunks, one is not a multiple of 16 bytes
    "embed": ([CHUNK_WORDS * 2 + 64, 2], torch.float32),
    "q": ([64, 32], torch.bfloat16),
    "bias": ([7], torch.bfloat16),
    "norm": ([32], torch.float32),
    "down": ([96, 32], torch.bfloat16),
}


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


def _export() -> tuple[dict, int]:
    tensors, pos = {}, 0
    for name, (shape, dtype) in SHAPES.items():
        pos = -(-pos // 256) * 256
        stride = [shape[1], 1] if len(shape) == 2 else [1]
        tensors[name] = {"offset": pos, "shape": shape, "stride": stride, "dtype": str(dtype).split(".")[-1]}
        pos += torch.Size(shape).numel() * dtype.itemsize
    return {"tensors": tensors}, pos


def _fresh(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(d).to(DEVICE) for n, (s, d) in SHAPES.items()}


def _check(writer: BufferWriter, new: dict[str, torch.Tensor]) -> None:
    for name, t in new.items():
        assert torch.equal(writer.view(name).cpu(), t.cpu()), name


@needs_kernel
def test_the_second_update_follows_the_learned_plan():
    export, size = _export()
    writer = BufferWriter(torch.zeros(size, dtype=torch.uint8, device=DEVICE), export)
    eligible = [n for n in SHAPES if n != "bias"]  # 14 bytes: the plan needs whole 16-byte units
    first = _fresh(1)
    writer.write((n, first[n]) for n in eligible)  # torch's copies; learns the plan
    _check(writer, {n: first[n] for n in eligible})
    plan_names, gather = writer._plan
    assert plan_names == tuple(eligible) and gather.launches == 0
    for seed in (2, 3):
        new = _fresh(seed)
        writer.write((n, new[n]) for n in eligible)
        _check(writer, {n: new[n] for n in eligible})
    assert gather.launches == 4 and writer._plan[1] is gather  # two parts per update


@needs_kernel
def test_a_stream_that_leaves_the_plan_is_still_copied_whole():
    export, size = _export()
    writer = BufferWriter(torch.zeros(size, dtype=torch.uint8, device=DEVICE), export)
    names = ["embed", "q", "norm", "down"]
    first = _fresh(1)
    writer.write((n, first[n]) for n in names)
    assert writer._plan is not None
    new = _fresh(2)
    writer.write((n, new[n]) for n in ["embed", "q", "down", "norm"])  # another order after the first part
    _check(writer, {n: new[n] for n in names})
    assert writer._plan is None  # relearned on the next update
    new = _fresh(3)
    writer.write((n, new[n]) for n in names)
    assert writer._plan is not None
    newer = _fresh(4)
    writer.write((n, newer[n]) for n in names[:2])  # a shorter stream: what it sent lands
    _check(writer, {n: newer[n] for n in names[:2]})
    _check(writer, {n: new[n] for n in names[2:]})
    assert writer._plan is None
