"""The machinery both ends of the control channel share (protocol: miles/wire/rpc.py).

`Endpoint` sends and seals envelopes, keeps pending calls as futures keyed by request id (with
their timers), drains its socket from the event loop's reader callback, checks every message's
seal and dispatches it: replies resolve calls, requests go to `request_handler`, notifications
to `notify_handler`. `RouterEndpoint` and `DealerEndpoint` (miles/wire/router_dealer.py) say how a
peer id maps onto socket frames.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import secrets
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import zmq

from miles.wire import codec
from miles.wire.rpc import MAX_FRAME_MB_ENV, Kind, RemoteError, RpcClosed, RpcStats, RpcTimeout

logger = logging.getLogger(__name__)

RequestHandler = Callable[[bytes, str, list, dict], Any]  # (peer, method, args, kwargs) -> value | awaitable
NotifyHandler = Callable[[bytes, str, Any], None]  # (peer, topic, payload)
MessageHook = Callable[[bytes], None]  # called with the peer id for every accepted message

# plain ints on the hot path: enum arithmetic costs microseconds per message
_REQUEST, _REPLY, _ERROR, _NOTIFY, _HELLO, _WELCOME = (int(k) for k in Kind)
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_ZERO_COPY_MIN_BYTES = 64 * 1024


@dataclasses.dataclass(slots=True)
class _Pending:
    future: asyncio.Future
    peer: bytes
    method: str
    timer: asyncio.TimerHandle | None


class Endpoint:
    """Shared machinery; subclasses say how a peer id maps onto socket frames."""

    _is_router = False

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        secret: bytes | None,
        name: str,
        identity: bytes,
        run_id: str | None,
        max_frame_bytes: int,
        known_peers: Iterable[bytes] | None = None,
    ) -> None:
        self._sock = sock
        self._auth = codec.FrameAuth(secret, identity, run_id) if secret is not None else None
        self.name = name
        self.max_frame_bytes = max_frame_bytes
        # the router takes messages only from these routing ids (None: from anyone)
        self.known_peers = set(known_peers) if known_peers is not None else None
        # the router's name -> routing id of the connection that last proved the key under that name
        self._routes: dict[bytes, bytes] = {}
        self._backlog: list[tuple[bytes, list]] | None = None  # messages held until the run id is known
        self._hello_nonce: bytes | None = None
        self.welcomed = asyncio.Event()  # set once the run id is known (at once when it was given)
        self.stats = RpcStats()
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._drain_scheduled = False
        self._closed = False
        self._n_small_frames = int(self._is_router) + int(secret is not None) + 1
        self.request_handler: RequestHandler | None = None
        self.notify_handler: NotifyHandler | None = None
        self.on_message: MessageHook | None = None
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        # the fd only signals after a read found the queue empty: look once so later arrivals wake us
        self._schedule_drain()

    # ---------------------------------------------------------------- sending
    def _send(self, peer: bytes, envelope: list) -> None:
        frames = codec.encode(envelope)
        for frame in frames:
            if len(frame) > self.max_frame_bytes:
                raise codec.CodecError(
                    f"{self.name}: a {len(frame) / 2**20:.1f} MiB frame exceeds the control channel's cap of "
                    f"{self.max_frame_bytes / 2**20:.1f} MiB per frame; send less per call, or raise "
                    f"{MAX_FRAME_MB_ENV} on every node"
                )
        if self._backlog is not None and envelope[0] != _HELLO:
            self._backlog.append((peer, frames))
            return
        self._send_frames(peer, frames)

    def _send_frames(self, peer: bytes, frames: list) -> None:
        if self._auth is not None:
            frames.insert(0, self._auth.seal(peer, frames))
        if self._is_router:
            route = self._routes.get(peer) if self._auth is not None else peer
            if route is None:  # no signed message from that name yet: never send to whoever took its id
                raise RpcClosed(f"{self.name}: peer {peer!r} is not connected (no signed message from it yet)")
            frames.insert(0, route)
        try:
            send = self._sock.send
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                # small frames are copied (cheaper than tracking); large buffers go zero-copy
                send(frame, _NOBLOCK if i == last else _SNDMORE_NOBLOCK, copy=len(frame) < _ZERO_COPY_MIN_BYTES)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise RpcClosed(f"{self.name}: peer {peer!r} is not connected (never registered or gone)") from e
            raise
        self.stats.sent += 1
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        # the ZMQ fd is edge-triggered and a send can swallow the edge: re-check once per loop turn
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def notify(self, peer: bytes, topic: str, payload: Any = None) -> None:
        """Fire-and-forget message (heartbeats, events)."""
        self._send(peer, [_NOTIFY, 0, topic, 0.0, payload])

    async def call(
        self,
        peer: bytes,
        method: str,
        args: list | tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Call ``method`` on ``peer``; raises RemoteError, RpcTimeout or RpcClosed."""
        if self._closed:
            raise RpcClosed(f"{self.name}: endpoint is closed; cannot call {method!r}")
        req_id = next(self._ids)
        deadline = time.time() + timeout_s if timeout_s else 0.0
        future = self._loop.create_future()
        timer = self._loop.call_later(timeout_s, self._expire, req_id, timeout_s) if timeout_s else None
        self._pending[req_id] = _Pending(future, peer, method, timer)
        try:
            self._send(peer, [_REQUEST, req_id, method, deadline, [list(args), kwargs or {}]])
        except BaseException:
            self._pop_pending(req_id)
            raise
        return await future

    def _pop_pending(self, req_id: int) -> _Pending | None:
        pending = self._pending.pop(req_id, None)
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()
        return pending

    def _expire(self, req_id: int, timeout_s: float) -> None:
        pending = self._pop_pending(req_id)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(
                RpcTimeout(
                    f"{self.name}: {_peer_name(pending.peer)}.{pending.method}() got no reply within "
                    f"{timeout_s:g} s; raise timeout_s if the method is legitimately slow"
                )
            )

    def fail_pending(self, exc: BaseException, peer: bytes | None = None) -> int:
        """Fail every pending call (of ``peer`` only, if given) with ``exc``; returns how many."""
        ids = [i for i, p in self._pending.items() if peer is None or p.peer == peer]
        for req_id in ids:
            pending = self._pop_pending(req_id)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(exc)
        return len(ids)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---------------------------------------------------------------- receiving
    def _drain(self) -> None:
        self._drain_scheduled = False
        sock = self._sock
        while not self._closed:
            # checking EVENTS is much cheaper than provoking zmq.Again on an empty socket
            try:
                if not sock.getsockopt(_EVENTS) & _POLLIN:
                    return
                frames = self._recv_message()
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            try:
                self._dispatch(frames)
            except Exception:  # noqa: BLE001 - one bad message must not kill the endpoint
                self.stats.dropped_malformed += 1
                logger.exception("%s: dropped a malformed message", self.name)

    def _recv_message(self) -> list:
        """Small leading frames (routing id, seal, header) as bytes; payload frames zero-copy."""
        sock = self._sock
        frames: list = [sock.recv(_NOBLOCK)]
        n_small = self._n_small_frames
        if self._is_router and self.known_peers is not None and self._name_of(frames[0]) not in self.known_peers:
            n_small = 1  # a stranger's frames are dropped unread: copy nothing
        while sock.getsockopt(_RCVMORE):
            frames.append(sock.recv(copy=len(frames) < n_small))
        return frames

    def _drop(self, reason: str, peer: bytes, detail: str) -> None:
        field = f"dropped_{reason}"
        n = getattr(self.stats, field) + 1
        setattr(self.stats, field, n)
        if n <= 10 or n % 1000 == 0:  # a flood must not flood the log
            logger.warning("%s: dropped a message from %r: %s (%d %s so far)", self.name, peer, detail, n, reason)

    def _name_of(self, route: bytes) -> bytes:
        """The worker name a routing id claims (signed dealers add ``#suffix``); proven only by a seal."""
        return route.split(b"#", 1)[0] if self._auth is not None else route

    def _dispatch(self, frames: list) -> None:
        route = frames[0] if self._is_router else b""
        peer = self._name_of(route)
        body = frames[1:] if self._is_router else frames
        if self.known_peers is not None and peer not in self.known_peers:
            self._drop("unknown_sender", peer, "not a worker or node agent of this run")
            return
        if self._auth is not None:
            if len(body) < 2:
                self._drop("unsigned", peer, f"{len(body)} frame(s): no seal and envelope")
                return
            try:
                run_id, counter = self._auth.open(
                    peer, body[0], [f if isinstance(f, bytes) else f.buffer for f in body[1:]]
                )
            except codec.FrameRefused as e:
                self._drop(e.reason, peer, str(e))
                return
            body = body[1:]
            if self._is_router:  # this connection proved the key under this name: replies go to it
                self._routes[peer] = route
        kind, req_id, method, deadline, payload = codec.decode(body)
        if self._auth is not None:
            if run_id != self._auth.run_id:
                self._handshake(peer, kind, run_id, counter, payload)
                return
            self._auth.accept(peer, counter)
        self.stats.received += 1
        if self.on_message is not None:
            self.on_message(peer)
        if kind == _REPLY or kind == _ERROR:
            self._resolve(peer, req_id, kind, payload)
        elif kind == _REQUEST:
            self._serve(peer, req_id, method, deadline, payload)
        elif kind == _NOTIFY:
            if self.notify_handler is not None:
                self.notify_handler(peer, method, payload)
        else:
            self.stats.dropped_malformed += 1

    def _handshake(self, peer: bytes, kind: int, run_id: bytes, counter: int, payload: Any) -> None:
        """The one exchange sealed without our run id: a hello, and the welcome that answers it."""
        auth = self._auth
        assert auth is not None
        if self._is_router and kind == _HELLO and run_id == codec.NO_RUN_ID and isinstance(payload, bytes):
            auth.accept(peer, counter)
            try:
                self._send(peer, [_WELCOME, 0, "", 0.0, payload])
            except RpcClosed:
                logger.warning("%s: %r left before its welcome", self.name, peer)
        elif not self._is_router and kind == _WELCOME and payload == self._hello_nonce:
            auth.accept(peer, counter)
            auth.adopt_run_id(run_id)
            self.welcomed.set()
            backlog, self._backlog = self._backlog or [], None
            for to, frames in backlog:
                self._send_frames(to, frames)
        else:
            self._drop("wrong_run", peer, f"message of kind {kind} sealed for another run ({run_id!r})")

    def _ask_for_run_id(self) -> None:
        """A signed dealer without the run id says hello and holds every other message until the welcome."""
        self._backlog = []
        self._hello_nonce = secrets.token_bytes(16)
        self._send(b"", [_HELLO, 0, "", 0.0, self._hello_nonce])

    def _resolve(self, peer: bytes, req_id: int, kind: int, payload: Any) -> None:
        pending = self._pop_pending(req_id)
        if pending is None or (self._is_router and pending.peer != peer):
            self.stats.dropped_unknown_reply += 1
            n = self.stats.dropped_unknown_reply
            if n <= 10 or n % 1000 == 0:
                logger.warning(
                    "%s: dropped a reply for unknown request id %s from %r (late after timeout, or forged; %d so far)",
                    self.name,
                    req_id,
                    peer,
                    n,
                )
            return
        if pending.future.done():
            return
        if kind == _REPLY:
            pending.future.set_result(payload)
        else:
            pending.future.set_exception(
                RemoteError(
                    _peer_name(peer) if self._is_router else "controller",
                    pending.method,
                    payload.get("type", "?"),
                    payload.get("message", ""),
                    payload.get("traceback", ""),
                )
            )

    def _serve(self, peer: bytes, req_id: int, method: str, deadline: float, payload: list) -> None:
        if deadline and time.time() > deadline:
            self._reply_error(peer, req_id, TimeoutError(f"deadline passed before {method!r} started"), "")
            return
        args, kwargs = payload
        try:
            if self.request_handler is None:
                raise LookupError(f"{self.name} serves no methods")
            result = self.request_handler(peer, method, args, kwargs)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
            self._reply_error(peer, req_id, e, traceback.format_exc())
            return
        if asyncio.iscoroutine(result):
            task = self._loop.create_task(result)
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._on_done, peer, req_id))
        elif isinstance(result, asyncio.Future):  # e.g. run_in_executor: no task needed
            result.add_done_callback(functools.partial(self._on_done, peer, req_id))
        elif isinstance(result, Awaitable):
            task = self._loop.create_task(_await(result))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._on_done, peer, req_id))
        else:
            self._reply(peer, req_id, result)

    def _on_done(self, peer: bytes, req_id: int, fut: asyncio.Future) -> None:
        self._tasks.discard(fut)  # type: ignore[arg-type]
        if fut.cancelled():
            self._reply_error(peer, req_id, RuntimeError("cancelled: the worker is shutting down"), "")
            return
        exc = fut.exception()
        if exc is None:
            self._reply(peer, req_id, fut.result())
        else:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self._reply_error(peer, req_id, exc, tb)

    def _reply(self, peer: bytes, req_id: int, result: Any) -> None:
        if self._closed:
            return
        try:
            self._send(peer, [_REPLY, req_id, "", 0.0, result])
        except codec.CodecError as e:
            self._reply_error(peer, req_id, e, traceback.format_exc())
        except RpcClosed:
            logger.warning("%s: caller %r left before its reply", self.name, peer)

    def _reply_error(self, peer: bytes, req_id: int, exc: BaseException, tb: str) -> None:
        if self._closed:
            return
        payload = {"type": type(exc).__qualname__, "message": str(exc), "traceback": tb}
        try:
            self._send(peer, [_ERROR, req_id, "", 0.0, payload])
        except RpcClosed:
            logger.warning("%s: caller %r left before its error reply", self.name, peer)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fail_pending(RpcClosed(f"{self.name}: endpoint closed"))
        for task in list(self._tasks):
            task.cancel()
        try:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        except (zmq.ZMQError, ValueError, RuntimeError):
            pass
        self._sock.close(linger=0)


async def _await(awaitable: Awaitable) -> Any:
    return await awaitable


def _peer_name(peer: bytes) -> str:
    return peer.decode(errors="replace") if peer else "controller"
