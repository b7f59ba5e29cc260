"""Node agent: one per node other than node 0; spawns the workers the controller places on its node.

The agent is itself a Worker (identity ``agent:<node>``) hosted in the launch process, so it
registers, heartbeats and leaves exactly like a worker does: when the controller says shutdown,
or goes silent for ``heartbeat_timeout_s``, or the agent's parent (torchrun/srun) dies. Its
workers connect straight to the controller; the agent only starts them, reports their deaths
(exit code, signal, log tail) and ends them on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from miles.wire import procs
from miles.wire.rpc import run_event_loop
from miles.workers.base import Worker, WorkerContext
from miles.workers.main import WorkerEnv, WorkerHost, setup_worker_logging

logger = logging.getLogger(__name__)

AGENT_ENTRY = "miles.workers.node_agent:NodeAgent"


class NodeAgent(Worker):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx)
        self._children: list[procs.ChildProcess] = []
        self._reported: set[int] = set()
        self._stopping = False
        self._watch_task: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def spawn(self, workers: list[dict[str, Any]], run_dir: str) -> list[int]:
        """Start the given workers (role, rank, env from the controller); returns their pids in order."""
        pids = []
        for w in workers:
            env = {**w["env"], "MILES_PARENT_PID": str(os.getpid())}
            child = procs.spawn_worker_process(w["role"], int(w["rank"]), env, run_dir)
            self._children.append(child)
            pids.append(child.pid)
        self.log.info("node %d: spawned %s", self.ctx.node, [c.name for c in self._children])
        return pids

    async def stop_workers(self, grace_s: float = 5.0) -> int:
        """Wait up to ``grace_s`` for this node's workers to leave (the controller told them to), then kill
        the rest; returns how many were still running when asked."""
        self._stopping = True
        running = sum(c.popen.poll() is None for c in self._children)
        await self._end_children(grace_s)
        return running

    async def _watch(self) -> None:
        while not self._stopping:
            for child in self._children:
                code = child.popen.poll()
                if code is None or child.pid in self._reported:
                    continue
                self._reported.add(child.pid)
                exitcode, sig = procs.describe_exit(code)
                self.log.error(
                    "node %d: %s pid=%d ended (exit code %s, signal %s)",
                    self.ctx.node,
                    child.name,
                    child.pid,
                    exitcode,
                    sig,
                )
                self.ctx.notify_controller(
                    "worker_exited",
                    {
                        "role": child.role,
                        "rank": child.rank,
                        "pid": child.pid,
                        "node": self.ctx.node,
                        "exitcode": exitcode,
                        "signal": sig,
                        "log_path": str(child.log_path),
                        "log_tail": procs.read_log_tail(child.log_path),
                    },
                )
            await asyncio.sleep(0.1)

    async def on_stop(self) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self._end_children()

    async def _end_children(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s  # the controller told the workers to stop too: let them
        while time.monotonic() < deadline and any(c.popen.poll() is None for c in self._children):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(procs.kill_tree, self._children, grace_s=2.0)


def run_agent(
    node: int,
    controller_addr: str,
    key: bytes,
    *,
    heartbeat_interval_s: float = 1.0,
    heartbeat_timeout_s: float = 30.0,
    register_timeout_s: float = 600.0,
) -> int:
    """Serve as node ``node``'s agent until the controller lets go; returns the exit code."""
    cfg = WorkerEnv(
        role="agent",
        rank=node,
        node=node,
        entry=AGENT_ENTRY,
        controller_addr=controller_addr,
        run_dir=".",
        secret=key,
        parent_pid=os.getppid(),
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        register_timeout_s=register_timeout_s,
    )
    procs.die_with_parent(cfg.parent_pid)
    setup_worker_logging(cfg.role, cfg.rank)

    async def _serve() -> int:
        return await WorkerHost(cfg, NodeAgent).run()

    return run_event_loop(_serve())
