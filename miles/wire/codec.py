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

Signed messages (TCP) carry one more leading frame, the seal (:class:`FrameAuth`): version, run id,
the sender's counter and an HMAC-SHA256 over run id, sender, recipient, counter and every other frame.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
import time
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
RUN_ID_BYTES = 16
NO_RUN_ID = bytes(RUN_ID_BYTES)  # claimed only by a worker that has not learnt the run id yet (hello)
SEAL_VERSION = 2
_SEAL = struct.Struct(f">B{RUN_ID_BYTES}sQ{SIGNATURE_BYTES}s")  # version, run id, counter, MAC
SEAL_BYTES = _SEAL.size

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


class FrameRefused(ValueError):
    """A signed message failed a check; ``reason`` is one of unsigned, bad_signature, wrong_run, replay."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


def run_id_field(run_id: str) -> bytes:
    raw = run_id.encode()
    if not 0 < len(raw) <= RUN_ID_BYTES:
        raise ValueError(f"run id {run_id!r} must be 1 to {RUN_ID_BYTES} bytes")
    return raw.ljust(RUN_ID_BYTES, b"\0")


class FrameAuth:
    """Seals one endpoint's outgoing messages and checks incoming ones.

    The MAC binds each message to the run, to who sent it and to whom (the controller is ``b""``,
    a worker its routing id), and to the sender's counter, which only goes up: the receiver keeps
    the last counter per sender and refuses one not above it. Counters start at the wall clock in
    nanoseconds, so a restarted sender still counts upwards from where its predecessor was.
    """

    __slots__ = ("_key", "identity", "run_id", "_counter", "_last_counter")

    def __init__(self, key: bytes, identity: bytes, run_id: str | None) -> None:
        self._key = key
        self.identity = identity
        self.run_id = run_id_field(run_id) if run_id else NO_RUN_ID
        self._counter = time.time_ns()
        self._last_counter: dict[bytes, int] = {}

    def _mac(self, run_id: bytes, sender: bytes, recipient: bytes, counter: int, frames: Sequence[Frame]) -> bytes:
        sender_len, recipient_len = len(sender).to_bytes(2, "big"), len(recipient).to_bytes(2, "big")
        context = b"".join(
            (b"miles-rpc-v2\0", run_id, sender_len, sender, recipient_len, recipient, counter.to_bytes(8, "big"))
        )
        return sign(self._key, [context, *frames])

    def seal(self, recipient: bytes, frames: Sequence[Frame]) -> bytes:
        """The seal frame that goes in front of ``frames`` on their way to ``recipient``."""
        self._counter += 1
        mac = self._mac(self.run_id, self.identity, recipient, self._counter, frames)
        return _SEAL.pack(SEAL_VERSION, self.run_id, self._counter, mac)

    def open(self, sender: bytes, seal: Frame, frames: Sequence[Frame]) -> tuple[bytes, int]:
        """Checks a message from ``sender``; returns (run id, counter) or raises FrameRefused.

        A run id other than ours passes only when one side claims NO_RUN_ID (the hello/welcome
        exchange by which a node agent learns the run id): the caller must then accept nothing
        but that exchange. The counter is not recorded: call :meth:`accept` once the message is taken.
        """
        if len(seal) != SEAL_BYTES:
            raise FrameRefused("unsigned", f"no {SEAL_BYTES}-byte seal in front (first frame has {len(seal)})")
        version, run_id, counter, mac = _SEAL.unpack(seal)
        if version != SEAL_VERSION or not hmac.compare_digest(
            mac, self._mac(run_id, sender, self.identity, counter, frames)
        ):
            raise FrameRefused("bad_signature", "mis-signed; is MILES_RUN_SECRET the same on every node?")
        # equal real run ids pass; so does the handshake, where exactly one side has no run id yet
        if (run_id != self.run_id or run_id == NO_RUN_ID) and (run_id == NO_RUN_ID) == (self.run_id == NO_RUN_ID):
            raise FrameRefused(
                "wrong_run",
                f"signed for run {_show_run(run_id)}, this is run {_show_run(self.run_id)}: "
                "a process of another run with the same secret?",
            )
        last = self._last_counter.get(sender, -1)
        if counter <= last:
            raise FrameRefused("replay", f"counter {counter} is not above the last one seen ({last}): a replay")
        return run_id, counter

    def accept(self, sender: bytes, counter: int) -> None:
        self._last_counter[sender] = counter

    def adopt_run_id(self, run_id: bytes) -> None:
        self.run_id = run_id


def _show_run(run_id: bytes) -> str:
    return run_id.rstrip(b"\0").decode(errors="replace") or "<none>"
