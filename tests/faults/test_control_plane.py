"""The control plane against a process without the run's key, and a node agent the controller never welcomes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import zmq

from miles.wire import codec
from miles.wire.router_dealer import DealerEndpoint, RouterEndpoint
from miles.wire.rpc import Kind, RpcClosed

KEY = codec.derive_key("the-run-secret")


async def _until(cond, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def test_a_process_without_the_key_cannot_hold_a_workers_identity():
    async def main() -> None:
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=KEY, run_id="run-a", peers=[b"trainer:0"])
        router.request_handler = lambda peer, method, args, kwargs: f"{method} from {peer.decode()}"
        squatter = ctx.socket(zmq.DEALER)
        squatter.setsockopt(zmq.ROUTING_ID, b"trainer:0")  # takes the worker's name before the worker starts
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.connect(router.address)
        squatter.send_multipart(codec.encode([Kind.REQUEST, 1, "register", 0.0, [[], {}]]))
        await _until(lambda: router.stats.dropped_unsigned == 1)
        with pytest.raises(RpcClosed):  # nothing goes to the name before the worker proved the key
            await router.call(b"trainer:0", "ping", timeout_s=5)

        worker = DealerEndpoint(ctx, router.address, "trainer:0", secret=KEY, run_id="run-a")
        worker.request_handler = lambda peer, method, args, kwargs: "pong"
        try:
            assert await worker.call_controller("register", timeout_s=10) == "register from trainer:0"
            assert await router.call(b"trainer:0", "ping", timeout_s=10) == "pong"
            with pytest.raises(zmq.Again):
                squatter.recv(zmq.NOBLOCK)  # the squatter never saw the controller's call
        finally:
            squatter.close(linger=0)
            worker.close()
            router.close()
            ctx.term()

    asyncio.run(main())


AGENT = """
import sys
from miles.wire import codec
from miles.workers.node_agent import run_agent
sys.exit(run_agent(1, sys.argv[1], codec.derive_key("the-run-secret"), register_timeout_s=1.0))
"""


def test_a_node_agent_never_welcomed_stops_in_one_line():
    async def main() -> subprocess.CompletedProcess:
        ctx = zmq.Context()
        # a controller with another key: the agent's hello is dropped, no welcome ever comes
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=codec.derive_key("another"), run_id="run-b")
        try:
            return await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", AGENT, router.address],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            router.close()
            ctx.term()

    done = asyncio.run(main())
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "no welcome from the controller" in errors[0], done.stderr
