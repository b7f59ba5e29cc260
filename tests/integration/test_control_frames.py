"""The control channel refuses replays, other runs, strangers and oversized frames (issue 25)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Callable

import psutil
import pytest
import zmq

from miles.controller.runtime import Runtime
from miles.wire import codec
from miles.wire.router_dealer import DealerEndpoint, RouterEndpoint
from miles.wire.rpc import Kind
from miles.wire.specs import WorkerSpec

NOOP = "miles.testing.noop:NoopWorker"
KEY = codec.derive_key("the-run-secret")
MIB = 1 << 20


def run(coro, timeout_s: float = 60.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(guarded())


async def wait_for_condition(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def raw_dealer(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a blocking read in a thread must end if the test fails
    sock.connect(address)
    return sock


def raw_tap(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A ROUTER standing between a worker and the controller, as an attacker on the path would."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def test_captured_frame_replayed_from_any_identity_is_refused() -> None:
    async def main():
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=KEY, run_id="run-a", peers=[b"w:0", b"w:1"])
        served: list[str] = []
        router.notify_handler = lambda peer, topic, payload: served.append(f"{peer.decode()} {topic}")

        # the worker talks to a tap, which records the bytes and passes them on
        tap, tap_address = raw_tap(ctx)
        worker = DealerEndpoint(ctx, tap_address, "w:0", secret=KEY, run_id="run-a")
        worker.notify_controller("stop_everything")
        captured = await asyncio.to_thread(tap.recv_multipart)
        assert captured[0].split(b"#")[0] == b"w:0" and len(captured[1]) == codec.SEAL_BYTES  # name#connection
        forward = raw_dealer(ctx, router.address, b"w:0")
        forward.send_multipart(captured[1:])
        await wait_for_condition(lambda: served == ["w:0 stop_everything"])

        forward.send_multipart(captured[1:])  # the same bytes again, same identity
        await wait_for_condition(lambda: router.stats.dropped_replay == 1)
        other_worker = raw_dealer(ctx, router.address, b"w:1")
        other_worker.send_multipart(captured[1:])  # a known identity that did not sign them
        await wait_for_condition(lambda: router.stats.dropped_bad_signature == 1)
        stranger = raw_dealer(ctx, router.address, b"intruder:0")
        stranger.send_multipart(captured[1:])  # an identity the controller does not expect
        await wait_for_condition(lambda: router.stats.dropped_unknown_sender == 1)
        assert served == ["w:0 stop_everything"]  # acted on once, never again

        for sock in (tap, forward, other_worker, stranger):
            sock.close(linger=0)
        worker.close()
        router.close()
        ctx.term()

    run(main())


def test_frame_sealed_for_another_run_is_refused() -> None:
    async def main():
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=KEY, run_id="run-a", peers=[b"w:0"])
        served: list[str] = []
        router.notify_handler = lambda peer, topic, payload: served.append(topic)
        stale = DealerEndpoint(ctx, router.address, "w:0", secret=KEY, run_id="run-b")  # same secret, other run
        stale.notify_controller("worker_exited", {})
        await wait_for_condition(lambda: router.stats.dropped_wrong_run == 1)
        assert served == [] and router.stats.received == 0
        stale.close()
        router.close()
        ctx.term()

    run(main())


def test_node_agent_learns_the_run_id_and_a_welcome_cannot_be_replayed() -> None:
    async def main():
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=KEY, run_id="run-a", peers=[b"agent:1"])
        router.request_handler = lambda peer, method, args, kwargs: f"{method} from {peer.decode()}"
        # the welcome goes through a tap so it can be replayed to a second agent
        tap, tap_address = raw_tap(ctx)
        upstream = raw_dealer(ctx, router.address, b"agent:1")
        agent = DealerEndpoint(ctx, tap_address, "agent:1", secret=KEY)  # no run id yet
        call = asyncio.ensure_future(agent.call_controller("register", timeout_s=20))
        hello = await asyncio.to_thread(tap.recv_multipart)
        upstream.send_multipart(hello[1:])
        welcome = await asyncio.to_thread(upstream.recv_multipart)
        tap.send_multipart([hello[0], *welcome])  # hello[0]: the agent's routing id, agent:1#<connection>
        register = await asyncio.to_thread(tap.recv_multipart)  # held until the welcome, now sealed for run-a
        upstream.send_multipart(register[1:])
        tap.send_multipart([hello[0], *await asyncio.to_thread(upstream.recv_multipart)])
        assert await call == "register from agent:1"

        second = DealerEndpoint(ctx, tap_address, "agent:2", secret=KEY)
        second_hello = await asyncio.to_thread(tap.recv_multipart)  # its hello, with its own nonce
        tap.send_multipart([second_hello[0], *welcome])  # the first agent's welcome replayed
        await wait_for_condition(lambda: second.stats.dropped_bad_signature == 1)  # sealed for agent:1
        assert second.stats.received == 0

        for sock in (tap, upstream):
            sock.close(linger=0)
        for endpoint in (agent, second, router):
            endpoint.close()
        ctx.term()

    run(main())


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_forged_worker_exited_from_a_stranger_does_not_stop_the_run(tmp_path, transport: str) -> None:
    async def main():
        opts = {"transport": transport, "secret": KEY} if transport == "tcp" else {}
        async with await Runtime.start([WorkerSpec("noop", 0, NOOP)], run_dir=str(tmp_path), **opts) as rt:
            death = {
                "role": "noop",
                "rank": 0,
                "pid": 1,
                "node": 1,
                "exitcode": 1,
                "signal": None,
                "log_path": "",
                "log_tail": "",
            }
            frames = codec.encode([Kind.NOTIFY, 0, "worker_exited", 0.0, death])
            if transport == "tcp":  # signed with the right key for the right run: only the sender is wrong
                frames.insert(0, codec.FrameAuth(KEY, b"agent:1", rt.run_id).seal(b"", frames))
            ctx = zmq.Context()
            forger = raw_dealer(ctx, rt.address, b"agent:1")
            forger.send_multipart(frames)
            await wait_for_condition(lambda: rt.stats.dropped_unknown_sender == 1)
            assert rt.failure is None
            assert await rt.worker("noop").call("echo", 7) == 7
            if transport == "ipc":
                assert stat.S_IMODE(os.stat(rt.address.removeprefix("ipc://")).st_mode) == 0o600
            forger.close(linger=0)
            ctx.term()

    run(main())


SEND_ONE_FRAME = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, b"w:0")
sock.setsockopt(zmq.LINGER, 20000)
sock.connect(sys.argv[1])
sock.send(bytes(int(sys.argv[2])), copy=False)
sock.close()
ctx.term()
"""


def test_oversized_frame_is_refused_before_it_is_allocated() -> None:
    frame_bytes = 512 * MIB

    async def main():
        ctx = zmq.Context()
        router = RouterEndpoint(
            ctx, "tcp://127.0.0.1:0", secret=KEY, run_id="run-a", peers=[b"w:0", b"w:1"], max_frame_bytes=16 * MIB
        )
        router.request_handler = lambda peer, method, args, kwargs: len(args[0])
        disconnects = router._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        rss_before = psutil.Process().memory_info().rss
        sender = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SEND_ONE_FRAME, router.address, str(frame_bytes), stderr=subprocess.DEVNULL
        )

        def refused_or_taken() -> bool:  # ZMQ drops the connection; without a cap the frame would arrive
            try:
                disconnects.recv_multipart(zmq.NOBLOCK)
                return True
            except zmq.Again:
                return router.stats.dropped_unsigned > 0

        await wait_for_condition(refused_or_taken, timeout_s=60)
        rss_growth = psutil.Process().memory_info().rss - rss_before
        assert router.stats.dropped_unsigned == 0  # never read, so never dropped by the endpoint
        assert rss_growth < frame_bytes // 8, f"receiver grew {rss_growth / MIB:.0f} MiB for a refused frame"
        await asyncio.wait_for(sender.wait(), 30)

        worker = DealerEndpoint(ctx, router.address, "w:1", secret=KEY, run_id="run-a", max_frame_bytes=16 * MIB)
        assert await worker.call_controller("size", b"x" * MIB, timeout_s=10) == MIB  # normal traffic flows
        with pytest.raises(codec.CodecError, match="exceeds the control channel's cap"):
            await worker.call_controller("size", bytes(17 * MIB), timeout_s=10)  # refused by the sender too
        disconnects.close(linger=0)
        worker.close()
        router.close()
        ctx.term()

    run(main(), timeout_s=120)


def test_frame_cap_comes_from_the_environment(monkeypatch) -> None:
    from miles.wire.rpc import max_frame_bytes_from_env

    monkeypatch.delenv("MILES_RPC_MAX_FRAME_MB", raising=False)
    assert max_frame_bytes_from_env() == 256 * MIB
    monkeypatch.setenv("MILES_RPC_MAX_FRAME_MB", "64")
    assert max_frame_bytes_from_env() == 64 * MIB
    monkeypatch.setenv("MILES_RPC_MAX_FRAME_MB", "lots")
    with pytest.raises(ValueError, match="MILES_RPC_MAX_FRAME_MB='lots'"):
        max_frame_bytes_from_env()
