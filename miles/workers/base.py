"""Base class of every worker process (trainer, rollout, reward, node agent).

A worker is an actor: it owns its state and answers RPC calls from the controller. Every public
method (name not starting with "_", other than the lifecycle hooks) is callable over RPC:

- ``async def`` methods run on the worker's event loop (keep them non-blocking);
- plain ``def`` methods run in a thread pool of ``sync_threads`` threads (default 1, so calls
  run one at a time and in arrival order), which keeps heartbeats flowing while torch computes.

Arguments and results follow :mod:`miles.wire.codec` (nested containers, numpy arrays,
torch tensors of any dtype). An exception reaches the caller as ``RemoteError`` with the
traceback text. The process side (connect, register, heartbeats, exit) is in
:mod:`miles.workers.main`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, ClassVar

LIFECYCLE_HOOKS = frozenset({"on_start", "on_stop", "warm_up"})


@dataclasses.dataclass(slots=True)
class WorkerContext:
    """What a worker knows about itself; handed to the constructor."""

    role: str
    rank: int
    run_dir: str
    node: int
    env: dict[str, str]
    logger: logging.Logger
    # fire-and-forget message to the controller (topic, payload); set by the hosting process
    notify_controller: Callable[[str, Any], None] = lambda topic, payload=None: None

    @property
    def name(self) -> str:
        return f"{self.role}:{self.rank}"


class Worker:
    """Subclass and add methods; see the module docstring for the calling rules."""

    sync_threads: ClassVar[int] = 1
    stop_timeout_s: ClassVar[float] = 30.0  # how long an orderly shutdown waits for on_stop

    def __init__(self, ctx: WorkerContext, **init_kwargs: Any) -> None:
        if init_kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected init_kwargs {sorted(init_kwargs)}; accept them in the "
                "subclass constructor or drop them from the WorkerSpec"
            )
        self.ctx = ctx
        self.log = ctx.logger

    async def on_start(self) -> None:
        """Called once after registration, before the worker reports ready."""

    def warm_up(self) -> None:
        """Work to begin as soon as the worker exists, without waiting for a call (loading a model while
        the controller is busy elsewhere). Runs on the worker's first sync thread, queued ahead of every
        call, after the worker reports ready: with one sync thread the calls wait for it, in order.
        An exception is logged; a method that needs the result re-raises it (see TrainerWorker.setup)."""

    async def on_stop(self) -> None:
        """Called on an orderly shutdown (not on SIGKILL)."""

    def whoami(self) -> dict[str, Any]:
        """Identity of this process; handy for tests and the launch self-test."""
        return {
            "role": self.ctx.role,
            "rank": self.ctx.rank,
            "node": self.ctx.node,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }


@dataclasses.dataclass(slots=True)
class RpcMethod:
    fn: Callable[..., Any]
    is_async: bool


def rpc_methods(worker: Worker) -> dict[str, RpcMethod]:
    """Public callables of ``worker`` by name."""
    methods: dict[str, RpcMethod] = {}
    for name in dir(type(worker)):
        if name.startswith("_") or name in LIFECYCLE_HOOKS:
            continue
        if not callable(inspect.getattr_static(type(worker), name, None)):
            continue
        bound = getattr(worker, name)
        methods[name] = RpcMethod(bound, inspect.iscoroutinefunction(bound))
    return methods
