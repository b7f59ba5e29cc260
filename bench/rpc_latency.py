"""Round-trip latency of the project's RPC vs raw pyzmq+msgpack (and a Ray actor when ray is importable).

    python bench/rpc_latency.py [--calls 2000] [--reps 5]

Measured side by side in one run, each figure the median over ``--reps`` repetitions of the p50/p99
of ``--calls`` sequential calls:
- rpc_noop:  ``await worker.call("noop")`` through Runtime (controller <-> worker process, IPC);
- zmq_noop:  a blocking DEALER -> ROUTER msgpack echo between two processes over IPC (the floor);
- rpc_1mib:  a call whose argument is a 1 MiB float32 tensor (small reply); rpc_1mib_echo sends it back too;
- ray_*:     the same calls on a Ray actor (null without ray; this bench never installs it);
- startup_4_workers_s: Runtime.start -> 4 no-op workers registered and ready.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.controller.runtime import Runtime  # noqa: E402
from miles.wire.rpc import run_event_loop  # noqa: E402
from miles.wire.specs import WorkerSpec  # noqa: E402

NOOP = "miles.testing.noop:NoopWorker"
MIB = 1 << 20


def pct(samples_s: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s) * 1e6, q))


def summarize(reps: list[list[float]]) -> tuple[float, float]:
    return statistics.median(pct(r, 50) for r in reps), statistics.median(pct(r, 99) for r in reps)


# ---------------------------------------------------------------- raw zmq baseline
def zmq_server(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, header = frames[0].bytes, frames[1].bytes
        req_id, method = msgpack.unpackb(header)[:2]
        if method == "stop":
            sock.send_multipart([ident, msgpack.packb([req_id, None])])
            return
        sock.send_multipart([ident, msgpack.packb([req_id, None])])


class RawZmqClient:
    """Blocking DEALER talking to the raw ROUTER echo server in another process."""

    def __init__(self) -> None:
        self.address = f"ipc://{tempfile.gettempdir()}/miles-bench-{os.getpid()}.sock"
        self.server = subprocess.Popen([sys.executable, __file__, "--zmq-server", self.address])
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(self.address)

    def call(self, i: int, payload: bytes | None) -> None:
        frames = [msgpack.packb([i, "noop", [], {}])]
        if payload is not None:
            frames.append(payload)
        self.sock.send_multipart(frames, copy=payload is None)
        msgpack.unpackb(self.sock.recv())

    def close(self) -> None:
        self.sock.send_multipart([msgpack.packb([0, "stop", [], {}])])
        self.sock.recv()
        self.server.wait(timeout=10)
        self.sock.close(linger=0)
        self.ctx.term()
        os.unlink(self.address.removeprefix("ipc://"))


def time_sync(n: int, fn) -> list[float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return samples


async def time_async(n: int, fn) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return samples


async def bench_side_by_side(calls: int, reps: int, run_dir: str) -> dict[str, list[list[float]]]:
    """Raw zmq and the project's RPC alternate repetition by repetition, so load drift hits both alike."""
    import torch

    tensor = torch.zeros(MIB // 4, dtype=torch.float32)
    raw_payload = bytes(MIB)
    n_big = max(50, calls // 10)
    results: dict[str, list[list[float]]] = {
        k: [] for k in ("zmq_noop", "rpc_noop", "zmq_1mib", "rpc_1mib", "rpc_1mib_echo")
    }
    raw = RawZmqClient()
    try:
        async with await Runtime.start([WorkerSpec("noop", 0, NOOP)], run_dir=run_dir) as rt:
            w = rt.worker("noop")
            for rep in range(reps + 1):  # rep 0 warms up
                sample = {
                    "zmq_noop": time_sync(calls, lambda i: raw.call(i, None)),
                    "rpc_noop": await time_async(calls, lambda: w.call("noop")),
                    "zmq_1mib": time_sync(n_big, lambda i: raw.call(i, raw_payload)),
                    "rpc_1mib": await time_async(n_big, lambda: w.call("sink", tensor)),
                    "rpc_1mib_echo": await time_async(n_big, lambda: w.call("echo", tensor)),
                }
                if rep:
                    for k, v in sample.items():
                        results[k].append(v)
    finally:
        raw.close()
    return results


async def bench_startup(n_workers: int, reps: int, run_dir: str) -> float:
    times = []
    for rep in range(reps):
        t0 = time.perf_counter()
        rt = await Runtime.start(
            [WorkerSpec("noop", i, NOOP) for i in range(n_workers)], run_dir=os.path.join(run_dir, f"startup{rep}")
        )
        times.append(time.perf_counter() - t0)
        await rt.shutdown()
    return statistics.median(times)


# ---------------------------------------------------------------- Ray (optional)
def bench_ray(calls: int, reps: int) -> dict[str, float | None]:
    try:
        import ray
    except ImportError:
        return {"noop": None, "1mib": None}
    import torch

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Actor:
        def noop(self) -> None:
            return None

        def sink(self, x) -> None:
            return None

    actor = Actor.remote()
    ray.get(actor.noop.remote())
    tensor = torch.zeros(MIB // 4, dtype=torch.float32)
    out: dict[str, float | None] = {}
    for name, fn in (("noop", lambda: actor.noop.remote()), ("1mib", lambda: actor.sink.remote(tensor))):
        per_rep = []
        for _ in range(reps):
            samples = []
            for _ in range(calls if name == "noop" else max(50, calls // 10)):
                t0 = time.perf_counter()
                ray.get(fn())
                samples.append(time.perf_counter() - t0)
            per_rep.append(samples)
        out[name] = summarize(per_rep)[0]
    ray.shutdown()
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--zmq-server":
        zmq_server(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    run_dir = tempfile.mkdtemp(prefix="miles-bench-rpc-")

    res = run_event_loop(bench_side_by_side(args.calls, args.reps, run_dir))
    zmq_noop, rpc_noop, zmq_1mib, rpc_1mib, rpc_echo = (
        summarize(res[k]) for k in ("zmq_noop", "rpc_noop", "zmq_1mib", "rpc_1mib", "rpc_1mib_echo")
    )
    startup_s = run_event_loop(bench_startup(4, 3, run_dir))
    ray = bench_ray(args.calls, args.reps)
    shutil.rmtree(run_dir, ignore_errors=True)

    print(f"{'case':<22}{'p50 us':>10}{'p99 us':>10}")
    for name, (p50, p99) in (
        ("raw zmq noop", zmq_noop),
        ("miles rpc noop", rpc_noop),
        ("raw zmq 1 MiB", zmq_1mib),
        ("miles rpc 1 MiB", rpc_1mib),
        ("miles rpc 1 MiB echo", rpc_echo),
    ):
        print(f"{name:<22}{p50:>10.1f}{p99:>10.1f}")
    print(f"ray noop p50: {ray['noop']}  ray 1 MiB p50: {ray['1mib']}")
    print(f"rpc/zmq noop p50 ratio: {ratio(rpc_noop[0], zmq_noop[0])} (target <= 1.5)")
    print(f"rpc/ray noop p50 ratio: {ratio(rpc_noop[0], ray['noop'])} (target <= 0.2)")
    print(f"rpc/ray 1 MiB p50 ratio: {ratio(rpc_1mib[0], ray['1mib'])} (target <= 0.5)")
    print(f"startup of 4 no-op workers: {startup_s:.2f} s (median of 3)")
    print(
        json.dumps(
            {
                "rpc_noop_p50_us": round(rpc_noop[0], 1),
                "rpc_noop_p99_us": round(rpc_noop[1], 1),
                "zmq_noop_p50_us": round(zmq_noop[0], 1),
                "ray_noop_p50_us": ray["noop"],
                "rpc_1mib_p50_us": round(rpc_1mib[0], 1),
                "ray_1mib_p50_us": ray["1mib"],
                "startup_4_workers_s": round(startup_s, 3),
                "zmq_1mib_p50_us": round(zmq_1mib[0], 1),
                "rpc_1mib_echo_p50_us": round(rpc_echo[0], 1),
                "rpc_over_zmq_noop_p50": ratio(rpc_noop[0], zmq_noop[0]),
                "calls": args.calls,
                "reps": args.reps,
            }
        )
    )


if __name__ == "__main__":
    main()
