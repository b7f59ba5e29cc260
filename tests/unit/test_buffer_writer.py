"""BufferWriter: every export entry lands at its offset, whatever its layout (CPU, no engine)."""

import pytest
import torch

from miles.weights.buffer_writer import BufferWriter


def _export(entries: dict[str, tuple[int, list[int], list[int], str]]) -> dict:
    return {
        "tensors": {k: {"offset": o, "shape": s, "stride": st, "dtype": d} for k, (o, s, st, d) in entries.items()},
        "aliases": {"lm_head.weight": "embed"},
    }


def test_contiguous_strided_overlapping_and_aliased_entries_land_at_their_offsets():
    flat = torch.zeros(1024, dtype=torch.uint8)
    export = _export(
        {
            "embed": (0, [4, 8], [8, 1], "bfloat16"),  # bytes 0..63
            "bias": (256, [3], [1], "float32"),  # after padding
            "transposed": (512, [2, 3], [1, 2], "bfloat16"),  # a column-major entry
            "overlap": (16, [8], [1], "bfloat16"),  # bytes 16..31, inside embed
        }
    )
    writer = BufferWriter(flat, export)
    embed = torch.arange(32, dtype=torch.bfloat16).view(4, 8)
    bias = torch.tensor([1.5, -2.0, 3.25])
    transposed = torch.arange(6, dtype=torch.bfloat16).view(2, 3) + 100
    assert writer.write([("lm_head.weight", embed), ("bias", bias), ("transposed", transposed)]) == (3, 64 + 12 + 12)
    assert torch.equal(flat[:64].view(torch.bfloat16).view(4, 8), embed)
    assert torch.equal(flat[256:268].view(torch.float32), bias)
    assert torch.equal(flat[512:524].view(torch.bfloat16).view(3, 2).t(), transposed)
    assert torch.equal(writer.view("overlap"), embed.reshape(-1)[8:16])  # the overlapping view sees embed's bytes
    assert not flat[64:256].any() and not flat[268:512].any()  # padding untouched


def test_bad_entries_and_names_are_named():
    with pytest.raises(ValueError, match="'big' at offset 0 runs past the 64-byte weight buffer"):
        BufferWriter(torch.zeros(64, dtype=torch.uint8), _export({"big": (0, [64], [1], "float32")})).view("big")
    writer = BufferWriter(torch.zeros(64, dtype=torch.uint8), _export({"a": (0, [4], [1], "float32")}))
    with pytest.raises(ValueError, match="the engine has no weight 'b'"):
        writer.write([("b", torch.zeros(4))])
    with pytest.raises(ValueError, match="shape mismatch for 'a'"):
        writer.write([("a", torch.zeros(5))])
