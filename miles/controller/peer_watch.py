"""How the runtime watches its peers: heartbeats out, and the verdict that one is dead, hung or late.

``send_heartbeats`` notifies every registered peer (a peer that already left is skipped: its exit
is noticed by ``check_peers`` or by its node agent). ``check_peers`` returns the first failure it
finds, or None: a local child that exited, a registered peer silent for more than
``heartbeat_timeout_s``, or a peer not ready ``register_timeout_s`` after the start. Each failure is
a ``WorkerDied`` with the exit code or signal and the log tail (``worker_died``); a death that a
node agent reports arrives as a ``worker_exited`` payload (``reported_death``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.controller.peers import Peer
from miles.wire import procs
from miles.wire.router_dealer import RouterEndpoint
from miles.wire.rpc import RpcClosed
from miles.wire.specs import RuntimeOptions, WorkerDied


def send_heartbeats(rpc: RouterEndpoint, peers: Iterable[Peer]) -> None:
    """One heartbeat to every registered peer."""
    for peer in peers:
        if peer.registered:
            try:
                rpc.notify(peer.identity, "hb")
            except RpcClosed:
                pass  # it left: its exit is noticed by poll or by its agent


def check_peers(peers: Iterable[Peer], now: float, started_at: float, opts: RuntimeOptions) -> WorkerDied | None:
    """The first peer that exited, hung or was not ready in time, as a WorkerDied; None if all are well."""
    for peer in peers:
        if peer.child is not None and peer.child.popen.poll() is not None:
            return worker_died(peer, "exited")
        if peer.registered and now - peer.last_seen > opts.heartbeat_timeout_s:
            return worker_died(
                peer,
                f"hung: no heartbeat for {now - peer.last_seen:.1f} s "
                f"(heartbeat_timeout_s={opts.heartbeat_timeout_s})",
            )
        if not peer.ready and now - started_at > opts.register_timeout_s:
            return worker_died(
                peer,
                f"was not ready within register_timeout_s={opts.register_timeout_s} (registered={peer.registered})",
            )
    return None


def worker_died(peer: Peer, reason: str) -> WorkerDied:
    """The failure of `peer`, with its exit code or signal (local children) and its log tail."""
    code = peer.child.popen.poll() if peer.child is not None else None
    exitcode, sig = procs.describe_exit(code)
    tail = procs.read_log_tail(peer.log_path) if peer.log_path else ""
    return WorkerDied(
        peer.role, peer.rank, peer.pid, exitcode, sig, tail, reason=reason, node=peer.node, log_path=peer.log_path
    )


def reported_death(p: dict[str, Any]) -> WorkerDied:
    """The failure a node agent reports in its ``worker_exited`` notification."""
    return WorkerDied(
        p["role"],
        p["rank"],
        p["pid"],
        p["exitcode"],
        p["signal"],
        p["log_tail"],
        node=p["node"],
        log_path=p["log_path"],
    )
