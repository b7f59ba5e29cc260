"""The colocated handoff's flat-buffer layout and the CPU shared-memory round trip."""

import torch

from miles.weights.tensor_ipc import ALIGN_BYTES, open_payload, pack, pack_layout


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(7, generator=gen).to(torch.bfloat16)),  # 14 bytes
        ("b", torch.randn(33, generator=gen)),  # 132 bytes, fp32
        ("c", torch.randint(0, 100, (3, 5), generator=gen, dtype=torch.int64)),  # 120 bytes
        ("d", torch.zeros(0, 4, dtype=torch.bfloat16)),  # empty
        ("e", torch.tensor(2.5, dtype=torch.float16)),  # 0-dim, 2 bytes
    ]


def test_layout_aligns_every_tensor():
    entries, total = pack_layout(_bucket())
    assert ALIGN_BYTES == 256
    assert [e["offset"] for e in entries] == [0, 256, 512, 768, 768]  # the empty tensor takes no room
    assert total == 768 + 2
    assert [e["shape"] for e in entries] == [[7], [33], [3, 5], [0, 4], []]
    assert [e["dtype"] for e in entries] == ["bfloat16", "float32", "int64", "bfloat16", "float16"]


def test_shared_memory_round_trip_is_bit_exact():
    bucket = _bucket()
    packed = pack(bucket)
    try:
        with open_payload(packed.payload) as named:
            got = {n: t.clone() for n, t in named}
    finally:
        packed.release()
    assert list(got) == [n for n, _ in bucket]
    for name, t in bucket:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert _raw(got[name]) == _raw(t)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
