"""Async RPC over ZeroMQ: ROUTER in the controller, DEALER in each worker.

Envelope (frame 0, msgpack via :mod:`miles.wire.codec`): ``[kind, request_id, method,
deadline_unix, payload]``; tensors and arrays ride in further frames. On TCP a leading seal frame
(:class:`miles.wire.codec.FrameAuth`) signs the run id, sender, recipient, the sender's counter
and all other frames with the per-run key; a message that is unsigned, mis-signed, for another run,
a replay, or from a peer the controller does not expect is dropped (counted in :class:`RpcStats`,
warned about at a bounded rate) and never acted on. A node agent, which gets the key but not the run
id, learns it first: its hello (sealed with no run id) is answered by a welcome carrying the run id
and bound to the hello's nonce; nothing else goes out before. Every frame is capped at
``max_frame_bytes`` (``MILES_RPC_MAX_FRAME_MB``, default 256) by ZMQ's MAXMSGSIZE, which reads the
size from the frame header and drops the connection before allocating.

Identity: with a key, a worker's ZMQ routing id is its name plus a random per-connection suffix
(``name#suffix``), and the router binds the name to a connection only when a message from it opens
with a valid seal. A process without the key cannot hold a worker's name: whatever routing id it
takes, the real worker's connection still gets through, and nothing is sent to a name before a
signed message bound it.

Both ends can call and serve: the controller calls worker methods; workers call the controller to
register. Replies resolve asyncio futures keyed by request id, so thousands of calls can be in
flight; a reply whose id is unknown (timed out, or forged) is logged and dropped.

Sockets are driven by the event loop's reader callback on the ZMQ file descriptor instead of
``zmq.asyncio``: one drain loop per wake-up costs less than a future per message.

This module holds the protocol's vocabulary (message kinds, errors, counters, the frame cap);
the machinery both ends share is miles/wire/endpoint.py, the two ends miles/wire/router_dealer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed (lower per-message overhead), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class Kind(enum.IntEnum):
    REQUEST = 0
    REPLY = 1
    ERROR = 2
    NOTIFY = 3
    HELLO = 4  # a dealer without the run id asks for it (payload: a nonce)
    WELCOME = 5  # the router's answer, sealed with the run id (payload: the hello's nonce)


MAX_FRAME_MB_ENV = "MILES_RPC_MAX_FRAME_MB"
_DEFAULT_MAX_FRAME_MB = 256  # control traffic; weights travel over their own transports


def max_frame_bytes_from_env() -> int:
    """The per-frame cap of the control channel: ``MILES_RPC_MAX_FRAME_MB`` MiB, default 256."""
    raw = os.environ.get(MAX_FRAME_MB_ENV, str(_DEFAULT_MAX_FRAME_MB))
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb <= 0:
        raise ValueError(f"{MAX_FRAME_MB_ENV}={raw!r} is not a positive whole number of MiB; e.g. 256")
    return mb << 20


class RemoteError(RuntimeError):
    """The remote method raised; carries the remote exception type and traceback text."""

    def __init__(self, peer: str, method: str, exc_type: str, message: str, remote_traceback: str) -> None:
        self.peer, self.method, self.exc_type = peer, method, exc_type
        self.remote_message, self.remote_traceback = message, remote_traceback
        super().__init__(
            f"{peer}.{method}() raised {exc_type}: {message}\n--- remote traceback ---\n{remote_traceback.rstrip()}"
        )


class RpcTimeout(TimeoutError):
    """No reply within the call's timeout."""


class RpcClosed(ConnectionError):
    """The endpoint was closed while the call was pending, or the peer cannot be reached."""


@dataclasses.dataclass(slots=True)
class RpcStats:
    sent: int = 0
    received: int = 0
    dropped_unsigned: int = 0
    dropped_bad_signature: int = 0
    dropped_wrong_run: int = 0
    dropped_replay: int = 0
    dropped_unknown_sender: int = 0
    dropped_unknown_reply: int = 0
    dropped_malformed: int = 0
