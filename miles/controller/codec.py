"""Wire codec: msgpack header + out-of-band buffers for numpy arrays and torch tensors.

A message is a list of frames: frame 0 is a msgpack document; every array or tensor larger than
``INLINE_MAX_BYTES`` becomes a msgpack ExtType that names (dtype, shape, frame index) and its raw
bytes travel as a separate frame, so large payloads are neither pickled nor copied into the
header. Decoding wraps received frames without copying: arrays and tensors share the received
frame's memory (read-only if the frame is, e.g. when decoding from ``bytes``). Small arrays are
inlined because an extra frame costs more than copying a few hundred bytes.

Supported values: None, bool, int, float, str, bytes, list/tuple (decoded as list), dict (any
msgpack-able keys), numpy arrays of any non-object dtype, numpy scalars (decoded as Python
scalars), torch tensors of any non-quantized dtype incl. bfloat16 and float8 (decoded on CPU).
"""

from __future__ import annotations

import hashlib
import hmac
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

INLINE_MAX_BYTES = 1024
_EXT_NDARRAY = 1
_EXT_TENSOR = 2
SIGNATURE_BYTES = 32  # HMAC-SHA256 digest size

Frame = bytes | memoryview


class CodecError(TypeError):
    """A value cannot be encoded, or a received message is malformed."""


def _numpy_header(arr: np.ndarray) -> tuple[str, list[int]]:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise CodecError(
            f"numpy dtype {arr.dtype!r} cannot cross the wire (object or structured dtype); "
            "convert to a plain numeric/bytes dtype or to Python lists first"
        )
    return arr.dtype.str, list(arr.shape)


def _raw_bytes_of_tensor(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy array (shares memory when already contiguous on CPU)."""
    import torch

    if t.is_sparse or t.is_quantized:
        raise CodecError(
            f"tensor layout/dtype {t.layout}/{t.dtype} is not supported on the wire; densify or dequantize it"
        )
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


class _Encoder:
    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: list[Frame] = []

    def _payload(self, raw: np.ndarray) -> bytes | int:
        # `raw` is C-contiguous uint8 or any C-contiguous array; nbytes decides inline vs frame
        if raw.nbytes <= INLINE_MAX_BYTES:
            return raw.tobytes()
        self.buffers.append(memoryview(raw).cast("B") if raw.ndim else memoryview(raw.reshape(1)).cast("B"))
        return len(self.buffers)  # frame index (frame 0 is the header)

    def default(self, obj: Any) -> Any:
        # torch is imported lazily: a process that never imported it cannot hold a tensor, and the
        # controller and light workers start faster without it
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            raw = _raw_bytes_of_tensor(obj)
            dtype_name = str(obj.dtype).removeprefix("torch.")
            meta = [dtype_name, list(obj.shape), self._payload(raw)]
            return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(meta, use_bin_type=True))
        if isinstance(obj, np.ndarray):
            dtype_str, shape = _numpy_header(obj)
            arr = np.ascontiguousarray(obj)
            meta = [dtype_str, shape, self._payload(arr.reshape(-1).view(np.uint8) if arr.size else arr)]
            return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb(meta, use_bin_type=True))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (set, frozenset)):
            return list(obj)
        raise CodecError(
            f"cannot encode value of type {type(obj).__module__}.{type(obj).__qualname__}; allowed: "
            "None/bool/int/float/str/bytes/list/tuple/dict, numpy arrays, torch tensors "
            "(convert dataclasses with dataclasses.asdict)"
        )


def encode(obj: Any) -> list[Frame]:
    """Encode ``obj`` into [header, *buffers]; buffers reference the source memory (no copy)."""
    enc = _Encoder()
    header = msgpack.packb(obj, default=enc.default, use_bin_type=True)
    return [header, *enc.buffers]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"received unknown torch dtype {name!r}; are both ends on the same torch version?")
    return dtype


def _decode_tensor(meta: list, frames: Sequence[Frame]) -> torch.Tensor:
    import torch

    name, shape, payload = meta
    dtype = _torch_dtype(name)
    buf = payload if isinstance(payload, bytes) else frames[payload]
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(payload, bytes):
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            # received frames are read-only to Python but privately owned: sharing them is safe
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _decode_ndarray(meta: list, frames: Sequence[Frame]) -> np.ndarray:
    dtype_str, shape, payload = meta
    buf = payload if isinstance(payload, bytes) else frames[payload]
    return np.frombuffer(buf, dtype=np.dtype(dtype_str)).reshape(shape)


def decode(frames: Sequence[Any]) -> Any:
    """Inverse of :func:`encode`. ``frames`` may be bytes, memoryviews or zmq.Frame objects."""
    if not frames:
        raise CodecError("empty message: expected at least a header frame")
    views = [f if isinstance(f, bytes) else memoryview(f) for f in frames]

    def ext_hook(code: int, data: bytes) -> Any:
        meta = msgpack.unpackb(data, raw=False)
        if isinstance(meta[2], int) and not 0 < meta[2] < len(views):
            raise CodecError(f"ext refers to frame {meta[2]} but the message has {len(views)} frames")
        if code == _EXT_TENSOR:
            return _decode_tensor(meta, views)
        if code == _EXT_NDARRAY:
            return _decode_ndarray(meta, views)
        return msgpack.ExtType(code, data)

    return msgpack.unpackb(views[0], ext_hook=ext_hook, raw=False, strict_map_key=False)


def sign(secret: bytes, frames: Sequence[Frame]) -> bytes:
    """HMAC-SHA256 over every frame, length-prefixed so frame boundaries are part of the signature."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


def derive_key(run_secret: str) -> bytes:
    """32-byte signing key from a user-chosen run secret (any string, e.g. MILES_RUN_SECRET)."""
    return hashlib.sha256(b"miles-rpc-key:" + run_secret.encode()).digest()


def verify(secret: bytes, signature: Frame, frames: Sequence[Frame]) -> bool:
    return len(signature) == SIGNATURE_BYTES and hmac.compare_digest(bytes(signature), sign(secret, frames))
