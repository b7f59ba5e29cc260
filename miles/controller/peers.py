"""The controller's records of its workers and node agents, and the handle that calls one worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from miles.wire.procs import ChildProcess
from miles.wire.specs import WorkerSpec


@dataclasses.dataclass(slots=True)
class Peer:
    """The controller's view of one worker or node agent."""

    role: str
    rank: int
    node: int
    identity: bytes
    spec: WorkerSpec | None = None
    child: ChildProcess | None = None
    pid: int | None = None
    log_path: str = ""
    registered: bool = False
    ready: bool = False
    last_seen: float = 0.0


# (peer, method, args, kwargs, timeout_s) -> the worker's result; the runtime's call path
CallPeer = Callable[[Peer, str, "tuple | list", dict, "float | None"], Awaitable[Any]]


class WorkerHandle:
    """Calls one worker's methods."""

    __slots__ = ("_call_peer", "_peer")

    def __init__(self, call_peer: CallPeer, peer: Peer) -> None:
        self._call_peer, self._peer = call_peer, peer

    role = property(lambda self: self._peer.role)
    rank = property(lambda self: self._peer.rank)
    pid = property(lambda self: self._peer.pid)
    node = property(lambda self: self._peer.node)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return await self._call_peer(self._peer, method, args, kwargs, timeout_s)

    def __repr__(self) -> str:
        return f"WorkerHandle({self.role}:{self.rank}, pid={self.pid}, node={self.node})"
