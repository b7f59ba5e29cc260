"""The two ends of the control channel: a ROUTER bound by the controller, a DEALER in each worker.

They differ in how a peer id maps onto socket frames and in identity: a signed worker connects
as ``name#suffix`` and, without the run id, first asks the controller for it (see miles/wire/rpc.py).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from typing import Any

import zmq

from miles.wire.endpoint import Endpoint
from miles.wire.rpc import max_frame_bytes_from_env


def _new_socket(ctx: zmq.Context, kind: int, max_frame_bytes: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    # ZMQ reads each frame's size from its header and drops a peer announcing more, before allocating
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    # unlimited queues, set before bind/connect (pipes keep the values they were created with):
    # thousands of calls in flight must neither block nor be dropped
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class RouterEndpoint(Endpoint):
    """Controller side: one bound ROUTER socket; peers are addressed by their ZMQ routing id."""

    _is_router = True

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        *,
        secret: bytes | None = None,
        run_id: str | None = None,
        peers: Iterable[bytes] | None = None,
        max_frame_bytes: int | None = None,
        name: str = "controller",
    ):
        """``secret`` signs every frame for run ``run_id`` (default: a fresh random id); ``peers``: the only
        routing ids whose messages are taken (default: any); ``max_frame_bytes``: default from the env."""
        max_frame_bytes = max_frame_bytes or max_frame_bytes_from_env()
        sock = _new_socket(ctx, zmq.ROUTER, max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error instead of a silent drop
        # no ROUTER_HANDOVER: a second connection claiming a live worker's id must not hijack its traffic
        if address.startswith("tcp://") and address.endswith(":0"):
            port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(address)
        if address.startswith("ipc://") and not address.startswith("ipc://@"):
            os.chmod(address.removeprefix("ipc://"), 0o600)  # unsigned IPC: only this user may connect
        self.address = address
        super().__init__(
            sock,
            secret=secret,
            name=name,
            identity=b"",
            run_id=run_id or secrets.token_hex(6),
            max_frame_bytes=max_frame_bytes,
            known_peers=peers,
        )


class DealerEndpoint(Endpoint):
    """Worker side: one DEALER connected to the controller; the peer argument is ignored."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        identity: str,
        *,
        secret: bytes | None = None,
        run_id: str | None = None,
        max_frame_bytes: int | None = None,
    ):
        """Without ``run_id`` a signed dealer first asks the controller for it (hello/welcome) and holds
        every other message until the answer."""
        max_frame_bytes = max_frame_bytes or max_frame_bytes_from_env()
        sock = _new_socket(ctx, zmq.DEALER, max_frame_bytes)
        if "#" in identity:
            raise ValueError(f"worker identity {identity!r} must not contain '#'")
        # signed: a fresh suffix, so a process without the key that took our name first cannot lock us out
        route = f"{identity}#{secrets.token_hex(8)}" if secret is not None else identity
        sock.setsockopt(zmq.ROUTING_ID, route.encode())
        sock.connect(address)
        super().__init__(
            sock,
            secret=secret,
            name=identity,
            identity=identity.encode(),
            run_id=run_id,
            max_frame_bytes=max_frame_bytes,
        )
        if secret is not None and not run_id:
            self._ask_for_run_id()
        else:
            self.welcomed.set()

    async def call_controller(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return await self.call(b"", method, args, kwargs, timeout_s)

    def notify_controller(self, topic: str, payload: Any = None) -> None:
        self.notify(b"", topic, payload)
