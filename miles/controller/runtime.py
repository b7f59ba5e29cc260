"""The controller's runtime: spawn workers, wait for them, watch them, tear everything down.

``Runtime.start(specs, ...)`` binds a ROUTER (IPC socket by default, TCP with HMAC signing for
several nodes), spawns the node-0 workers as local subprocesses (each in its own session), asks
the node agents of the other nodes to spawn theirs, and returns once every worker has registered
and reported ready. From then on a monitor task polls local children, exchanges heartbeats with
every peer and turns the first death or hang into one ``WorkerDied`` (role, rank, pid, exit code
or signal, log tail): every pending and later call raises it, ``wait_failure()`` returns it, and
the whole run is torn down. ``shutdown()`` is idempotent and ends every child on every path;
workers also leave by themselves if the controller vanishes (see ``miles.workers.main``).

The parts it delegates: ``control_socket`` (the IPC socket file, stale ones of killed runs),
``peer_watch`` (heartbeats and the verdict that a peer died, hung or was late) and ``teardown``
(waiting for, then killing, the local children; stopping the node agents' workers).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import secrets
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from miles.controller import peer_watch, teardown
from miles.controller.control_socket import ipc_socket_path, remove_ipc_socket
from miles.controller.peers import Peer, WorkerHandle
from miles.wire import codec, procs
from miles.wire.router_dealer import RouterEndpoint
from miles.wire.rpc import RpcClosed, RpcStats
from miles.wire.specs import AGENT_ROLE, RunInterrupted, RuntimeOptions, WorkerSpec, validate_specs

logger = logging.getLogger(__name__)

# Seconds past the heartbeat time-out that a call whose peer's connection is gone waits for the loss to be
# declared (the monitor polls every 0.1 s), so that it raises the failure naming the worker, not the socket's
LOSS_GRACE_S = 2.0


class Runtime:
    """Owns the worker processes of one run; build it with ``await Runtime.start(...)``."""

    def __init__(self, specs: list[WorkerSpec], opts: RuntimeOptions) -> None:
        run_dir, transport, num_nodes = opts.run_dir, opts.transport, opts.num_nodes
        self.opts = opts
        validate_specs(specs, transport, num_nodes)
        self.run_id = uuid.uuid4().hex[:12]
        self.run_dir = str(Path(run_dir).resolve())
        self.num_nodes, self.transport = num_nodes, transport
        self._secret = opts.secret if transport == "tcp" else None
        if transport == "tcp" and self._secret is None:
            env_secret = os.environ.get("MILES_RUN_SECRET", "")
            self._secret = codec.derive_key(env_secret) if env_secret else secrets.token_bytes(32)
        self._zmq = zmq.Context()
        self._ipc_dir: str | None = None
        self._ipc_path: str | None = None
        if transport == "ipc":
            self._ipc_path, self._ipc_dir = ipc_socket_path(self.run_dir, self.run_id)
            bind = f"ipc://{self._ipc_path}"
        else:
            bind = f"tcp://{opts.host}:{opts.port}"
        self._peers: dict[bytes, Peer] = {}
        for spec in specs:
            ident = spec.name.encode()
            self._peers[ident] = Peer(
                spec.role,
                spec.rank,
                spec.node,
                ident,
                spec=spec,
                log_path=str(procs.log_path_for(self.run_dir, spec.role, spec.rank)),
            )
        for node in range(1, num_nodes):
            ident = f"{AGENT_ROLE}:{node}".encode()
            self._peers[ident] = Peer(AGENT_ROLE, node, node, ident)
        # only the workers and agents of this plan are heard; on TCP every frame is sealed for this run id
        self.rpc = RouterEndpoint(self._zmq, bind, secret=self._secret, run_id=self.run_id, peers=self._peers)
        self.address = self.rpc.address
        if transport == "tcp" and opts.advertise_host:
            self.address = f"tcp://{opts.advertise_host}:{self.address.rsplit(':', 1)[1]}"
        self.rpc.request_handler = self._on_request
        self.rpc.notify_handler = self._on_notify
        self.rpc.on_message = self._on_message
        self._failure: BaseException | None = None
        self._failure_future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._progress = asyncio.Event()  # set whenever a peer registers/readies or the run fails
        self._monitor_task: asyncio.Task | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._closing = False
        self._owner_task = asyncio.current_task()
        self._signals_installed: list[int] = []
        self._started_at = time.monotonic()
        self._all_ready_logged = False
        atexit.register(self._kill_children_sync)

    # ------------------------------------------------------------------ start
    @classmethod
    async def start(
        cls,
        specs: list[WorkerSpec],
        *,
        run_dir: str,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 30.0,
        register_timeout_s: float = 120.0,
        transport: str = "ipc",
        num_nodes: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: bytes | None = None,
        default_timeout_s: float | None = None,
        shutdown_grace_s: float = 5.0,
        install_signal_handlers: bool = True,
        wait_ready: bool = True,
    ) -> Runtime:
        """Spawn ``specs`` and return once all are ready; raises WorkerDied (after teardown) otherwise.

        ``wait_ready=False`` returns once every worker is spawned; the caller then awaits
        ``wait_ready(role)`` for the workers it needs first (and ``wait_ready()`` for all), and shuts
        the runtime down if that raises.

        ``transport="tcp"`` signs every frame with ``secret`` (default: derived from MILES_RUN_SECRET, else
        random) and binds ``host:port`` (0: a free port); workers reach it at ``advertise_host`` if given.
        """
        opts = RuntimeOptions(
            run_dir,
            heartbeat_interval_s,
            heartbeat_timeout_s,
            register_timeout_s,
            transport,
            num_nodes,
            host,
            port,
            advertise_host,
            secret,
            default_timeout_s,
            shutdown_grace_s,
        )
        rt = cls(specs, opts)
        try:
            if install_signal_handlers:
                rt._install_signal_handlers()
            logger.info("runtime %s listening on %s; run_dir=%s", rt.run_id, rt.address, rt.run_dir)
            rt._monitor_task = asyncio.get_running_loop().create_task(rt._monitor())
            for peer in rt._peers.values():
                if peer.spec is not None and peer.node == 0:
                    rt._spawn_local(peer)
            await rt._wait_until(lambda p: p.role == AGENT_ROLE)
            await asyncio.gather(*(rt._spawn_remote(node) for node in range(1, num_nodes)))
            if wait_ready:
                await rt.wait_ready()
        except BaseException:
            await rt.shutdown()
            raise
        return rt

    async def wait_ready(self, role: str | None = None) -> None:
        """Until every worker (of ``role``, when given) has reported ready; raises the run's failure."""
        await self._wait_until(lambda p: role is None or p.role == role)
        if role is None and not self._all_ready_logged:
            self._all_ready_logged = True
            workers = sum(p.spec is not None for p in self._peers.values())
            logger.info(
                "runtime %s: %d workers ready in %.2f s", self.run_id, workers, time.monotonic() - self._started_at
            )

    def worker_env(self, spec: WorkerSpec, parent_pid: int) -> dict[str, str]:
        """Environment of a worker process (also sent to node agents for their workers)."""
        env = {
            "MILES_CONTROLLER_ADDR": self.address,
            "MILES_RUN_ID": self.run_id,
            "MILES_RUN_DIR": self.run_dir,
            "MILES_ROLE": spec.role,
            "MILES_RANK": str(spec.rank),
            "MILES_NODE": str(spec.node),
            "MILES_WORKER_ENTRY": spec.entry,
            "MILES_PARENT_PID": str(parent_pid),
            "MILES_HEARTBEAT_INTERVAL_S": str(self.opts.heartbeat_interval_s),
            "MILES_HEARTBEAT_TIMEOUT_S": str(self.opts.heartbeat_timeout_s),
            "MILES_REGISTER_TIMEOUT_S": str(self.opts.register_timeout_s),
        }
        if self._secret is not None:
            env["MILES_RPC_KEY"] = self._secret.hex()
        return {**env, **spec.env}

    def _spawn_local(self, peer: Peer) -> None:
        assert peer.spec is not None
        peer.child = procs.spawn_worker_process(
            peer.role, peer.rank, self.worker_env(peer.spec, os.getpid()), self.run_dir
        )
        peer.pid = peer.child.pid

    async def _spawn_remote(self, node: int) -> None:
        specs = [p.spec for p in self._peers.values() if p.spec is not None and p.node == node]
        payload = [{"role": s.role, "rank": s.rank, "env": self.worker_env(s, 0)} for s in specs]
        pids = await self._call(
            self._peers[f"{AGENT_ROLE}:{node}".encode()],
            "spawn",
            (payload, self.run_dir),
            {},
            self.opts.register_timeout_s,
        )
        for spec, pid in zip(specs, pids, strict=True):
            self._peers[spec.name.encode()].pid = pid

    async def _wait_until(self, which: Any) -> None:
        while True:
            if self._failure is not None:
                raise self._failure
            if all(p.ready for p in self._peers.values() if which(p)):
                return
            self._progress.clear()
            await self._progress.wait()

    # ------------------------------------------------------------------ messages
    def _on_message(self, ident: bytes) -> None:
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_seen = time.monotonic()

    def _on_request(self, ident: bytes, method: str, args: list, kwargs: dict) -> Any:
        peer = self._peers.get(ident)
        if peer is None:
            raise LookupError(
                f"unknown peer {ident!r}: not in this run's placement plan ({sorted(p.decode() for p in self._peers)})"
            )
        if method == "register":
            peer.registered, peer.pid = True, kwargs.get("pid", peer.pid)
            if self.num_nodes > 1:  # where each process of a multi-node run really is
                logger.info("%s registered from host %s (node %d)", ident.decode(), kwargs.get("hostname"), peer.node)
            self._progress.set()
            return {"init_kwargs": peer.spec.init_kwargs if peer.spec else {}, "run_id": self.run_id}
        if method == "ready":
            peer.ready = True
            self._progress.set()
            return None
        raise AttributeError(f"the controller has no method {method!r} for {ident.decode()}")

    def _on_notify(self, ident: bytes, topic: str, payload: Any) -> None:
        if topic == "worker_exited" and not self._closing:
            reporter = self._peers.get(ident)
            if reporter is None or reporter.role != AGENT_ROLE:  # only node agents report deaths
                logger.warning("ignored worker_exited from %s, which is not a node agent", ident.decode())
                return
            self._fail(peer_watch.reported_death(payload))

    # ------------------------------------------------------------------ monitoring
    async def _monitor(self) -> None:
        poll_s = min(0.1, self.opts.heartbeat_interval_s)
        next_beat = 0.0
        while not self._closing:
            now = time.monotonic()
            failure = peer_watch.check_peers(self._peers.values(), now, self._started_at, self.opts)
            if failure is not None:
                self._fail(failure)
                return
            if now >= next_beat:
                next_beat = now + self.opts.heartbeat_interval_s
                peer_watch.send_heartbeats(self.rpc, self._peers.values())
            await asyncio.sleep(poll_s)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is not None or self._closing:
            return
        logger.error("%s", exc)
        self._failure = exc
        self._failure_future.set_result(exc)
        self._progress.set()
        self.rpc.fail_pending(exc)
        self._shutdown_task = asyncio.get_running_loop().create_task(self._do_shutdown())

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    async def wait_failure(self) -> BaseException:
        """Returns the first failure (WorkerDied or RunInterrupted) once it happens."""
        return await asyncio.shield(self._failure_future)

    # ------------------------------------------------------------------ calls
    async def _call(self, peer: Peer, method: str, args: tuple | list, kwargs: dict, timeout_s: float | None) -> Any:
        if self._failure is not None:
            raise self._failure
        if self._closing:
            raise RpcClosed(f"runtime {self.run_id} is shut down; cannot call {peer.role}:{peer.rank}.{method}")
        timeout = timeout_s if timeout_s is not None else self.opts.default_timeout_s
        try:
            return await self.rpc.call(peer.identity, method, args, kwargs, timeout)
        except RpcClosed:
            if self._failure is None and not self._closing:
                # the connection went before the loss was declared (a lost node's peers are declared when their
                # heartbeats time out): wait for that verdict, which names the worker and its node
                try:
                    await asyncio.wait_for(self.wait_failure(), self.opts.heartbeat_timeout_s + LOSS_GRACE_S)
                except TimeoutError:
                    pass
            if self._failure is not None:
                raise self._failure from None
            raise

    def worker(self, role: str, rank: int = 0) -> WorkerHandle:
        peer = self._peers.get(f"{role}:{rank}".encode())
        if peer is None or peer.spec is None:
            raise KeyError(f"no worker {role}:{rank}; this run has {sorted(str(p.spec.name) for p in self._specs())}")
        return WorkerHandle(self._call, peer)

    def workers(self, role: str) -> list[WorkerHandle]:
        return [WorkerHandle(self._call, p) for p in sorted(self._specs(), key=lambda p: p.rank) if p.role == role]

    def _specs(self) -> list[Peer]:
        return [p for p in self._peers.values() if p.spec is not None]

    async def call_all(
        self, role: str, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list:
        """Call ``method`` on every worker of ``role`` concurrently; results in rank order."""
        handles = self.workers(role)
        if not handles:
            raise KeyError(f"no workers with role {role!r}; roles: {sorted({p.role for p in self._specs()})}")
        return list(await asyncio.gather(*(h.call(method, *args, timeout_s=timeout_s, **kwargs) for h in handles)))

    @property
    def stats(self) -> RpcStats:
        return self.rpc.stats

    def local_pids(self) -> list[int]:
        return [p.child.pid for p in self._peers.values() if p.child is not None]

    # ------------------------------------------------------------------ teardown
    async def shutdown(self) -> None:
        """Idempotent: orderly stop, then SIGTERM/SIGKILL of every process group still alive."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self._do_shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _do_shutdown(self) -> None:
        self._closing = True
        self._progress.set()
        if self._monitor_task is not None and self._monitor_task is not asyncio.current_task():
            self._monitor_task.cancel()
        for peer in self._peers.values():
            if peer.registered and peer.role != AGENT_ROLE:  # agents go last, after their workers
                try:
                    self.rpc.notify(peer.identity, "shutdown")
                except RpcClosed:
                    pass
        await teardown.wait_children_exit(
            self.rpc, self._peers.values(), self.opts.shutdown_grace_s, self.opts.heartbeat_timeout_s
        )
        await asyncio.to_thread(self._kill_children_sync)
        self.rpc.fail_pending(self._failure or RpcClosed(f"runtime {self.run_id} shut down"))
        self.rpc.close()
        self._zmq.term()
        remove_ipc_socket(self._ipc_path, self._ipc_dir)
        self._remove_signal_handlers()
        atexit.unregister(self._kill_children_sync)
        logger.info("runtime %s shut down", self.run_id)

    def _kill_children_sync(self) -> None:
        teardown.kill_children(self._peers.values(), self.run_id)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals_installed.append(sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals_installed:
            loop.remove_signal_handler(sig)
        self._signals_installed.clear()

    def _on_signal(self, sig: int) -> None:
        self._fail(RunInterrupted(f"controller received {signal.Signals(sig).name}; tearing down run {self.run_id}"))
        if self._owner_task is not None and not self._owner_task.done():
            self._owner_task.cancel()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.shutdown()
