"""How the runtime's processes end: local children waited for then killed, node agents told to stop theirs.

``wait_children_exit`` gives the workers ``grace_s`` to leave by themselves after the runtime told
them to shut down: it waits for the local children and asks every node agent that still answers
(heard from within ``heartbeat_timeout_s``) to wait for, then kill, its workers before the agent
itself is let go (``stop_remote``). ``kill_children`` then ends every local process group still
alive; it is also what runs at interpreter exit, so no path leaves a child behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from miles.controller.peers import Peer
from miles.wire import procs
from miles.wire.router_dealer import RouterEndpoint
from miles.wire.rpc import RpcClosed
from miles.wire.specs import AGENT_ROLE

logger = logging.getLogger(__name__)


def local_children(peers: Iterable[Peer]) -> list[procs.ChildProcess]:
    """The processes this controller spawned itself."""
    return [p.child for p in peers if p.child is not None]


def kill_children(peers: Iterable[Peer], run_id: str) -> None:
    """SIGTERM, then SIGKILL, every local child's process group that is still alive."""
    procs.kill_tree(local_children(peers), grace_s=2.0, run_id=run_id)


async def wait_children_exit(
    rpc: RouterEndpoint, peers: Iterable[Peer], grace_s: float, heartbeat_timeout_s: float
) -> None:
    """Up to `grace_s` for the local children to exit, while the live node agents stop theirs."""
    peers = list(peers)
    agents = [p for p in peers if p.role == AGENT_ROLE and p.registered]
    now = time.monotonic()
    for agent in [a for a in agents if now - a.last_seen > heartbeat_timeout_s]:
        # a lost or cut-off node cannot answer; its agent ends its workers once the controller falls silent
        logger.warning("node %d agent silent for %.1f s: not waiting for it", agent.node, now - agent.last_seen)
        agents.remove(agent)
    remote = [stop_remote(rpc, agent, grace_s) for agent in agents]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(c.popen.poll() is None for c in local_children(peers)):
        await asyncio.sleep(0.05)
    await asyncio.gather(*remote)


async def stop_remote(rpc: RouterEndpoint, agent: Peer, grace_s: float) -> None:
    """Have a node agent wait for (then kill) its workers, then let the agent itself go."""
    try:
        await rpc.call(agent.identity, "stop_workers", (grace_s,), {}, grace_s + 5.0)
    except Exception as e:  # noqa: BLE001 - a dead agent cannot be helped from here; its node cleans up
        logger.warning("node %d agent did not confirm its workers stopped: %s", agent.node, e)
    try:
        rpc.notify(agent.identity, "shutdown")
    except RpcClosed:
        pass
