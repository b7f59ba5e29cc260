"""The checkpoint shard writer process: what it writes reads back as DCP's own writer's records, and its
failures come back as the save's error."""

from __future__ import annotations

import io

import pytest
import torch

from miles.trainer.shard_writer import ShardWriterProcess, SnapshotArena

LAYOUT = [(("a",), (3, 5), torch.float32), (("b", 0), (7,), torch.bfloat16), (("c",), (), torch.int64)]


@pytest.fixture
def arena():
    a = SnapshotArena(LAYOUT)
    yield a
    a.close()


def test_the_arena_lays_out_aligned_views_and_locates_them(arena):
    assert [tuple(arena.views[k].shape) for k, _, _ in LAYOUT] == [(3, 5), (7,), ()]
    assert all(v.data_ptr() % 64 == 0 for v in arena.views.values())
    a = arena.views[("a",)]
    assert arena.locate(a) == (0, 60)
    assert arena.locate(a[1]) == (20, 20)  # a contiguous row
    assert arena.locate(a[:, 1]) is None  # not contiguous
    assert arena.locate(torch.zeros(3)) is None  # elsewhere


def test_the_process_writes_records_that_load_back(arena, tmp_path):
    for k, shape, dtype in LAYOUT:
        arena.views[k].copy_(torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype))
    proc = ShardWriterProcess(arena)
    try:
        items = [(0, b"raw bytes")]
        items += [
            (i + 1, (*arena.locate(arena.views[k]), str(d).removeprefix("torch."), s))
            for i, (k, s, d) in enumerate(LAYOUT)
        ]
        path = tmp_path / "shard.distcp"
        spans = proc.write(str(path), items, sync=True)
        data = path.read_bytes()
        assert [i for i, _, _ in spans] == [0, 1, 2, 3]
        _, off, n = spans[0]
        assert data[off : off + n] == b"raw bytes"
        for (_, off, n), (k, _, _) in zip(spans[1:], LAYOUT, strict=True):
            got = torch.load(io.BytesIO(data[off : off + n]), weights_only=True)
            assert got.dtype == arena.views[k].dtype and torch.equal(got, arena.views[k])
            assert got.untyped_storage().nbytes() == got.nbytes  # its own elements only, not the arena's

        with pytest.raises(OSError, match="no-such-dir"):
            proc.write(str(tmp_path / "no-such-dir" / "shard.distcp"), items, sync=True)
        assert proc.write(str(path), items, sync=False) == spans  # still serving after a failure
    finally:
        proc.close()
    assert proc._proc.returncode == 0
