"""Round trips through the wire codec: every torch/numpy dtype, odd shapes, non-contiguous views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.wire import codec

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (5, 33), (2, 3, 4, 50)]  # (2,3,4,50) exceeds the inline limit


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
    )
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)  # random bit patterns incl. NaNs: compare bits, not values


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _roundtrip(obj):
    frames = codec.encode(obj)
    # what the receiver sees: independent byte copies, like frames off a socket
    return codec.decode([bytes(f) for f in frames])


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_roundtrip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _random_tensor(shape, dtype)
    out = _roundtrip({"t": t})["t"]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert _bits(out) == _bits(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.complex64], ids=str)
def test_torch_non_contiguous_views(dtype: torch.dtype) -> None:
    base = _random_tensor((12, 40), dtype, seed=1)
    views = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": base[:1].expand(5, 40),
        "negative_step_via_flip": base.flip(0),
    }
    out = _roundtrip(views)
    for name, view in views.items():
        assert not view.is_contiguous() or name == "negative_step_via_flip"
        assert out[name].shape == view.shape, name
        assert _bits(out[name]) == _bits(view), name


def test_bfloat16_values_survive() -> None:
    values = [1.0, -2.5, 3.140625, 0.0, -0.0, float("inf"), 65280.0]  # all exactly representable in bf16
    out = _roundtrip(torch.tensor(values, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == values


@pytest.mark.parametrize(
    "dtype",
    ["?", "u1", "i1", "<i2", "<i4", "<i8", "<u8", "<f2", "<f4", "<f8", ">f4", "<c8", "<c16", "<M8[ns]", "S5", "<U3"],
)
@pytest.mark.parametrize("shape", [(), (0,), (4,), (3, 5), (2, 3, 400)])
def test_numpy_roundtrip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    arr = np.frombuffer(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(), dtype=dtype).reshape(shape)
    out = _roundtrip([arr])[0]
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    assert out.tobytes() == arr.tobytes()


def test_numpy_non_contiguous() -> None:
    arr = np.arange(600, dtype=np.float32).reshape(20, 30)
    views = [arr.T, arr[::2, ::3], arr[:, 5], np.broadcast_to(arr[0], (4, 30))]
    out = _roundtrip(views)
    for got, want in zip(out, views, strict=True):
        np.testing.assert_array_equal(got, want)


def test_nested_structures_and_scalars() -> None:
    msg = {
        "a": [1, 2.5, "x", None, True, b"\x00\xff"],
        3: {"nested": (4, 5)},
        "np_scalar": np.float32(1.5),
        "big": np.ones(1000, dtype=np.int32),
        "small": np.arange(3),
    }
    out = _roundtrip(msg)
    assert out["a"] == [1, 2.5, "x", None, True, b"\x00\xff"]
    assert out[3] == {"nested": [4, 5]}  # tuples come back as lists
    assert out["np_scalar"] == 1.5 and isinstance(out["np_scalar"], float)
    assert out["big"].sum() == 1000 and out["small"].tolist() == [0, 1, 2]


def test_large_arrays_travel_out_of_band_without_copy() -> None:
    arr = np.arange(1 << 16, dtype=np.float64)
    frames = codec.encode({"x": arr})
    assert len(frames) == 2 and len(frames[0]) < 100  # header is small; the data is frame 1
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float64), arr)
    back = codec.decode(frames)["x"]
    assert np.shares_memory(back, np.frombuffer(frames[1], dtype=np.float64))  # zero-copy on receive


def test_rejects_what_would_need_pickle() -> None:
    with pytest.raises(codec.CodecError, match="object"):
        codec.encode(np.array([object()], dtype=object))
    with pytest.raises(codec.CodecError, match="cannot encode"):
        codec.encode({"f": lambda: 0})


def test_signature_detects_any_tampering() -> None:
    key = codec.derive_key("run-secret")
    frames = [bytes(f) for f in codec.encode({"x": np.arange(2000)})]
    sig = codec.sign(key, frames)
    assert codec.verify(key, sig, frames)
    assert not codec.verify(codec.derive_key("other"), sig, frames)
    tampered = [frames[0], frames[1][:-1] + bytes([frames[1][-1] ^ 1])]
    assert not codec.verify(key, sig, tampered)
    # moving a byte across a frame boundary keeps the concatenation but must still fail
    assert not codec.verify(key, sig, [frames[0] + frames[1][:1], frames[1][1:]])
    assert not codec.verify(key, b"short", frames)


def test_seal_binds_run_sender_recipient_and_counter() -> None:
    key = codec.derive_key("run-secret")
    frames = [bytes(f) for f in codec.encode({"topic": "worker_exited"})]
    worker = codec.FrameAuth(key, b"w:0", "run-a")
    controller = codec.FrameAuth(key, b"", "run-a")
    seal = worker.seal(b"", frames)
    run_id, counter = controller.open(b"w:0", seal, frames)
    assert run_id == codec.run_id_field("run-a")
    controller.accept(b"w:0", counter)

    def refusal(auth: codec.FrameAuth, sender: bytes, seal: bytes, frames: list) -> str:
        with pytest.raises(codec.FrameRefused) as err:
            auth.open(sender, seal, frames)
        return err.value.reason

    assert refusal(controller, b"w:0", seal, frames) == "replay"  # same bytes again
    assert refusal(controller, b"w:1", seal, frames) == "bad_signature"  # same bytes, other sender
    assert refusal(codec.FrameAuth(key, b"w:1", "run-a"), b"", seal, frames) == "bad_signature"  # other recipient
    other_run = codec.FrameAuth(key, b"w:0", "run-b").seal(b"", frames)
    assert refusal(controller, b"w:0", other_run, frames) == "wrong_run"
    assert refusal(controller, b"w:0", codec.sign(key, frames), frames) == "unsigned"  # the old 32-byte signature
    forged = bytearray(worker.seal(b"", frames))
    forged[20] ^= 1  # raise the counter by hand: the MAC covers it
    assert refusal(controller, b"w:0", bytes(forged), frames) == "bad_signature"
    later = worker.seal(b"", frames)
    assert controller.open(b"w:0", later, frames)[1] > counter
