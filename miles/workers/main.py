"""Worker process entry: ``python -m miles.workers.main`` (spawned by the runtime or a node agent).

Reads its identity from the environment (``WorkerEnv``), connects a DEALER to the controller,
registers (the reply carries the constructor kwargs), builds the Worker, reports ready, then
serves calls until told to stop. It exits on its own when the controller goes silent for
``heartbeat_timeout_s``, when its parent process dies (PR_SET_PDEATHSIG plus a parent-pid poll),
or on SIGTERM; on the way out it ends everything it spawned. A worker forked from a warm server
(`miles.wire.forkserver`) has that server as its parent: it dies with it, and watches its spawner
(``MILES_PARENT_PID``) by pid.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import zmq

from miles.utils.misc import load_function
from miles.wire.procs import die_with_parent, kill_own_descendants, parent_alive
from miles.wire.router_dealer import DealerEndpoint
from miles.wire.rpc import run_event_loop
from miles.workers.base import RpcMethod, Worker, WorkerContext, rpc_methods

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_CONTROLLER_LOST = 0, 1, 3


@dataclasses.dataclass(slots=True)
class WorkerEnv:
    role: str
    rank: int
    node: int
    entry: str
    controller_addr: str
    run_dir: str
    secret: bytes | None
    parent_pid: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    register_timeout_s: float
    run_id: str | None = None  # signed frames are sealed for it; None: learnt from the controller (node agents)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        missing = [
            k for k in ("MILES_ROLE", "MILES_RANK", "MILES_WORKER_ENTRY", "MILES_CONTROLLER_ADDR") if k not in env
        ]
        if missing:
            raise RuntimeError(
                f"worker started without {missing}; workers are spawned by the miles runtime, not by hand"
            )
        secret_hex = env.get("MILES_RPC_KEY", "")  # hex signing key set by the runtime (TCP only)
        return cls(
            role=env["MILES_ROLE"],
            rank=int(env["MILES_RANK"]),
            node=int(env.get("MILES_NODE", "0")),
            entry=env["MILES_WORKER_ENTRY"],
            controller_addr=env["MILES_CONTROLLER_ADDR"],
            run_dir=env.get("MILES_RUN_DIR", "."),
            secret=bytes.fromhex(secret_hex) if secret_hex else None,
            parent_pid=int(env.get("MILES_PARENT_PID", "0")),
            heartbeat_interval_s=float(env.get("MILES_HEARTBEAT_INTERVAL_S", "1.0")),
            heartbeat_timeout_s=float(env.get("MILES_HEARTBEAT_TIMEOUT_S", "30.0")),
            register_timeout_s=float(env.get("MILES_REGISTER_TIMEOUT_S", "120.0")),
            run_id=env.get("MILES_RUN_ID") or None,
        )


def setup_worker_logging(role: str, rank: int) -> logging.Logger:
    """One line per record on stderr, which the spawner points at logs/<role>_<rank>.log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {role}:{rank} pid=%(process)d %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("MILES_LOG_LEVEL", "INFO"))
    return logging.getLogger(f"miles.worker.{role}.{rank}")


class WorkerHost:
    """Runs one Worker inside this process: RPC, heartbeats, lifecycle."""

    def __init__(self, cfg: WorkerEnv, worker_cls: type[Worker] | None = None) -> None:
        self.cfg = cfg
        self.identity = f"{cfg.role}:{cfg.rank}"
        self._worker_cls = worker_cls
        self._zmq = zmq.Context()
        self.rpc = DealerEndpoint(self._zmq, cfg.controller_addr, self.identity, secret=cfg.secret, run_id=cfg.run_id)
        self.rpc.request_handler = self._handle
        self.rpc.notify_handler = self._on_notify
        self.rpc.on_message = self._seen
        self._last_seen = time.monotonic()
        self._registered = False
        self._stop = asyncio.Event()
        self.exit_code = EXIT_OK
        self.worker: Worker | None = None
        self._methods: dict[str, RpcMethod] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._warm_up: asyncio.Future | None = None

    def _seen(self, _peer: bytes) -> None:
        self._last_seen = time.monotonic()

    def request_stop(self, code: int, why: str) -> None:
        if not self._stop.is_set():
            logger.log(logging.INFO if code == EXIT_OK else logging.ERROR, "stopping (exit %d): %s", code, why)
            self.exit_code = code
            self._stop.set()

    def _on_notify(self, _peer: bytes, topic: str, payload: Any) -> None:
        if topic == "shutdown":
            self.request_stop(EXIT_OK, "controller asked to shut down")
        elif topic != "hb":
            logger.debug("ignored notification %r", topic)

    def _handle(self, _peer: bytes, method: str, args: list, kwargs: dict) -> Any:
        target = self._methods.get(method)
        if target is None:
            state = "is still starting" if self.worker is None else f"has no RPC method {method!r}"
            raise AttributeError(
                f"{self.identity} ({self.cfg.entry}) {state}; public methods: {sorted(self._methods)}"
            )
        if target.is_async:
            return target.fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(target.fn, *args, **kwargs))

    async def _heartbeat(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        while True:
            self.rpc.notify_controller("hb")
            silent_s = time.monotonic() - self._last_seen
            if self._registered and silent_s > self.cfg.heartbeat_timeout_s:
                self.request_stop(
                    EXIT_CONTROLLER_LOST,
                    f"no message from the controller for {silent_s:.1f} s "
                    f"(heartbeat_timeout_s={self.cfg.heartbeat_timeout_s})",
                )
            if self.cfg.parent_pid and not parent_alive(self.cfg.parent_pid):
                self.request_stop(EXIT_CONTROLLER_LOST, f"parent process {self.cfg.parent_pid} died")
            await asyncio.sleep(interval)

    async def _welcome(self) -> bool:
        """Wait for the controller's welcome (node agents learn the run id from it); False: none came in time."""
        try:
            await asyncio.wait_for(self.rpc.welcomed.wait(), timeout=self.cfg.register_timeout_s)
        except TimeoutError:
            self.request_stop(
                EXIT_ERROR,
                f"{self.identity}: no welcome from the controller at {self.cfg.controller_addr} within "
                f"{self.cfg.register_timeout_s:g} s; check that node 0 runs the same launch command, that the "
                "address and port are reachable from this node, and that MILES_RUN_SECRET is the same on every node",
            )
            return False
        return True

    async def _start_worker(self) -> None:
        if not await self._welcome():
            return
        reply = await self.rpc.call_controller(
            "register",
            role=self.cfg.role,
            rank=self.cfg.rank,
            node=self.cfg.node,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            timeout_s=self.cfg.register_timeout_s,
        )
        self._registered = True
        self._last_seen = time.monotonic()
        # the entry's import (torch, the model code) takes seconds: off the loop, so heartbeats keep flowing
        cls = self._worker_cls or await asyncio.to_thread(load_function, self.cfg.entry)
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"worker entry {self.cfg.entry!r} is {cls!r}, not a miles.workers.base.Worker subclass")
        ctx = WorkerContext(
            role=self.cfg.role,
            rank=self.cfg.rank,
            run_dir=self.cfg.run_dir,
            node=self.cfg.node,
            env=dict(os.environ),
            logger=logging.getLogger(f"miles.worker.{self.identity}"),
            notify_controller=self.rpc.notify_controller,
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max(1, cls.sync_threads), thread_name_prefix=f"rpc-{self.identity}"
        )
        # constructors load models: run them off the loop so heartbeats keep flowing
        init_kwargs = reply.get("init_kwargs") or {}
        loop = asyncio.get_running_loop()
        self.worker = await loop.run_in_executor(self._executor, functools.partial(cls, ctx, **init_kwargs))
        await self.worker.on_start()
        self._methods = rpc_methods(self.worker)
        # queued first on the sync thread: calls that arrive after "ready" run once it is done
        self._warm_up = loop.run_in_executor(self._executor, self.worker.warm_up)
        self._warm_up.add_done_callback(_log_warm_up_failure)
        await self.rpc.call_controller("ready", timeout_s=self.cfg.register_timeout_s)
        logger.info("ready: %s serving %d methods", self.identity, len(self._methods))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Slurm delivers the pre-timeout SIGUSR1 to every process of the step; stopping is the controller's
        # call (checkpoint first), so workers and whatever they start ignore it
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.request_stop, 128 + sig, f"received {signal.Signals(sig).name}")
        heartbeat = loop.create_task(self._heartbeat())
        starter = loop.create_task(self._start_worker())
        stopper = loop.create_task(self._stop.wait())
        try:
            await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if starter.done() and starter.exception() is not None:
                raise starter.exception()
            await stopper
        finally:
            for task in (heartbeat, starter, stopper):
                task.cancel()
            await self._stop_worker()
        return self.exit_code

    async def _stop_worker(self) -> None:
        if self.worker is not None and self.exit_code != EXIT_CONTROLLER_LOST:
            try:
                await asyncio.wait_for(self.worker.on_stop(), timeout=self.worker.stop_timeout_s)
            except Exception:  # noqa: BLE001 - still exit; the log keeps the reason
                logger.exception("on_stop failed")
        self.rpc.close()
        self._zmq.term()
        kill_own_descendants()


def _log_warm_up_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("warm_up failed (the call that needs it raises the error)", exc_info=fut.exception())


async def _run_host(cfg: WorkerEnv) -> int:
    return await WorkerHost(cfg).run()  # built inside the loop: the endpoint binds to the running loop


def main() -> None:
    cfg = WorkerEnv.from_environ()
    die_with_parent(cfg.parent_pid)
    setup_worker_logging(cfg.role, cfg.rank)
    code = EXIT_ERROR
    try:
        code = run_event_loop(_run_host(cfg))
    except BaseException:  # noqa: BLE001 - the traceback goes to the log the controller reads
        logger.exception("worker %s:%d failed", cfg.role, cfg.rank)
        code = EXIT_ERROR
        kill_own_descendants()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # sync methods may still be running in non-daemon threads; do not wait for them
        os._exit(code)


if __name__ == "__main__":
    main()
