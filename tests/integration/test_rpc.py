"""RPC over real ZMQ sockets: many calls in flight, tensors, errors, timeouts, signing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
import zmq

from miles.controller.runtime import Runtime
from miles.wire import codec
from miles.wire.router_dealer import DealerEndpoint, RouterEndpoint
from miles.wire.rpc import Kind, RemoteError, RpcTimeout
from miles.wire.specs import WorkerSpec

NOOP = "miles.testing.noop:NoopWorker"


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


def test_2000_concurrent_calls_and_tensors_across_processes(tmp_path) -> None:
    async def main():
        async with await Runtime.start([WorkerSpec("noop", 0, NOOP)], run_dir=str(tmp_path)) as rt:
            w = rt.worker("noop")
            calls = [w.call("echo" if i % 2 else "echo_sync", {"i": i, "arr": np.full(3, i)}) for i in range(2000)]
            results = await asyncio.gather(*calls)
            assert [r["i"] for r in results] == list(range(2000))
            assert all(r["arr"].tolist() == [i] * 3 for i, r in enumerate(results))
            assert rt.rpc.num_pending == 0

            bf16 = torch.linspace(-3, 3, 4096).to(torch.bfloat16).reshape(64, 64).t()  # non-contiguous, 8 KiB
            big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
            out = await w.call("echo", [bf16, big, np.arange(10, dtype=np.uint16)[::2]])
            assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], bf16)
            assert torch.equal(out[1], big)
            assert out[2].dtype == np.uint16 and out[2].tolist() == [0, 2, 4, 6, 8]

    run(main())


def test_remote_errors_and_timeouts(tmp_path) -> None:
    async def main():
        async with await Runtime.start([WorkerSpec("noop", 0, NOOP)], run_dir=str(tmp_path)) as rt:
            w = rt.worker("noop")
            with pytest.raises(RemoteError) as err:
                await w.call("fail", "boom-42")
            assert err.value.exc_type == "ValueError" and "boom-42" in str(err.value)
            assert "def fail" in err.value.remote_traceback or "in fail" in err.value.remote_traceback
            with pytest.raises(RemoteError, match="has no RPC method 'nope'"):
                await w.call("nope")
            with pytest.raises(RemoteError, match="_private"):
                await w.call("_private")
            with pytest.raises(RpcTimeout, match="noop:0.sleep"):
                await w.call("sleep", 0.5, timeout_s=0.05)
            # the late reply arrives for an id nobody waits for: logged, dropped and counted
            await wait_for_condition(lambda: rt.stats.dropped_unknown_reply == 1)
            assert await w.call("echo", 7) == 7  # the channel is still healthy

    run(main())


def test_reply_with_unknown_id_is_dropped() -> None:
    async def main():
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "inproc://unknown-id")
        dealer = DealerEndpoint(ctx, "inproc://unknown-id", "w:0")
        dealer.request_handler = lambda peer, method, args, kwargs: sum(args)
        assert await router.call(b"w:0", "add", [1, 2], timeout_s=5) == 3
        dealer._send(b"", [Kind.REPLY, 999_999, "", 0.0, "forged"])  # no such request id
        await wait_for_condition(lambda: router.stats.dropped_unknown_reply == 1)
        assert await router.call(b"w:0", "add", [4, 5], timeout_s=5) == 9
        router.close()
        dealer.close()
        ctx.term()

    run(main())


def test_mis_signed_and_unsigned_frames_are_rejected() -> None:
    async def main():
        key = codec.derive_key("the-run-secret")
        ctx = zmq.Context()
        router = RouterEndpoint(ctx, "tcp://127.0.0.1:0", secret=key, run_id="run-a")
        served: list[str] = []
        router.request_handler = lambda peer, method, args, kwargs: served.append(peer.decode()) or "ok"
        good = DealerEndpoint(ctx, router.address, "good:0", secret=key, run_id="run-a")
        assert await good.call_controller("hello", timeout_s=10) == "ok"

        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.ROUTING_ID, b"rogue:0")
        rogue.connect(router.address)
        request = codec.encode([Kind.REQUEST, 1, "hello", 0.0, [[], {}]])
        rogue.send_multipart(request)  # unsigned
        wrong_key = codec.FrameAuth(codec.derive_key("wrong-secret"), b"rogue:0", "run-a")
        rogue.send_multipart([wrong_key.seal(b"", request), *request])
        right_key = codec.FrameAuth(key, b"rogue:0", "run-a")
        tampered = codec.encode([Kind.REQUEST, 1, "hellO", 0.0, [[], {}]])
        rogue.send_multipart([right_key.seal(b"", request), *tampered])  # right key, body changed after signing
        await wait_for_condition(lambda: router.stats.dropped_unsigned + router.stats.dropped_bad_signature == 3)
        assert router.stats.dropped_unsigned == 1 and router.stats.dropped_bad_signature == 2
        assert served == ["good:0"]  # nothing from the rogue reached the handler

        rogue.send_multipart([right_key.seal(b"", request), *request])  # a correctly sealed frame is accepted
        await wait_for_condition(lambda: len(served) == 2)
        rogue.close(linger=0)
        good.close()
        router.close()
        ctx.term()

    run(main())


def test_tcp_runtime_signs_every_frame(tmp_path) -> None:
    async def main():
        os.environ.pop("MILES_RUN_SECRET", None)
        async with await Runtime.start([WorkerSpec("noop", 0, NOOP)], run_dir=str(tmp_path), transport="tcp") as rt:
            assert rt.address.startswith("tcp://127.0.0.1:")
            assert await rt.worker("noop").call("echo", np.arange(5000)) is not None
            rogue = zmq.Context.instance().socket(zmq.DEALER)
            rogue.setsockopt(zmq.ROUTING_ID, b"rogue:1")
            rogue.connect(rt.address)
            frames = codec.encode([Kind.NOTIFY, 0, "hb", 0.0, None])
            guess = codec.FrameAuth(codec.derive_key("guess"), b"rogue:1", rt.run_id)
            rogue.send_multipart([guess.seal(b"", frames), *frames])
            await wait_for_condition(lambda: rt.stats.dropped_unknown_sender == 1)  # not in the plan: unread
            rogue.close(linger=0)
            assert await rt.worker("noop").call("echo", 1) == 1

    run(main())
