"""A stand-in engine for weight-sync tests and benchmarks: a dict of HF-named tensors behind
a WeightReceiver, served over a tiny aiohttp app in its own process.

`spawn_engine()` starts one such process; `HTTPEngineControl` is the matching client (the
weight endpoints as async methods, like `EngineClient`). `/dump` returns every tensor's raw
bytes (base64) so a test can compare them with the trainer's on its own.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import torch

from miles.weights.arena import SharedWeights, wait_for_writer
from miles.weights.groups import dtype_from_name, dtype_name
from miles.weights.verify import CHECKER_ACTIONS
from miles.wire.ports import free_port

logger = logging.getLogger(__name__)

TensorSpec = list[tuple[str, list[int], str]]  # (HF name, shape, dtype name)


class FakeEngine:
    """Implements what WeightReceiver needs: load_weights, named_weights, weight_version, flush_cache."""

    def __init__(self, spec: TensorSpec, device: str = "cpu", seed: int = 0, std: float = 1.0) -> None:
        # CPU engines draw on the CPU (bit-reproducible in tests); device engines draw on the device (fast).
        gen = torch.Generator(device).manual_seed(seed)
        self.tensors = {
            name: (torch.randn(shape, generator=gen, device=device) * std).to(dtype_from_name(dt))
            for name, shape, dt in spec
        }
        self.device = device
        self.weight_version = 0
        self.flushes = 0
        self.installs = 0
        self._shared = SharedWeights(device)  # the shared weight buffer, once a direct update asked for it

    # direct colocated updates: the tensors become views of one shared buffer on first export
    def export_weight_buffer(self, generation: int | None = None, for_mapping: bool = False) -> dict:
        if self._shared.arena is None:
            self.repack()
        if self._shared.device.type == "cuda":
            torch.cuda.synchronize(self._shared.device)
        return self._shared.export(self.tensors, None, generation, for_mapping=for_mapping)

    def install_weight_buffer(self, generation: int, weight_version: int, ready_event: str | None = None) -> None:
        wait_for_writer(ready_event, self.device)
        self._shared.check_install(generation)
        self.installs += 1
        self.weight_version = weight_version

    def repack(self) -> None:
        """Move the tensors into a fresh shared buffer (a new generation), as a memory resume does."""
        self.tensors = self._shared.pack(self.tensors)

    def close(self) -> None:
        self._shared.close()

    def load_weights(self, named) -> None:
        for name, t in named:
            dst = self.tensors.get(name)
            if dst is None:
                raise ValueError(f"engine has no tensor {name!r}")
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(
                    f"tensor {name!r}: shape {list(t.shape)} does not match the engine's {list(dst.shape)}"
                )
            dst.copy_(t)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True


def _serve(spec: TensorSpec, port: int, device: str, seed: int, skip_tensor: str | None, std: float) -> None:
    from aiohttp import web

    from miles.weights.receiver import WeightReceiver

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    engine = FakeEngine(spec, device, seed, std)
    if skip_tensor is not None:  # fault injection: this engine silently drops one tensor on every load
        original = engine.load_weights
        engine.load_weights = lambda named: original([(n, t) for n, t in named if n != skip_tensor])
    receiver = WeightReceiver(engine, timeout_s=60)

    async def handle(request: web.Request) -> web.Response:
        method = request.match_info["method"]
        body = await request.json() if request.can_read_body else {}
        try:
            if method == "reset":  # back to the startup weights and version 0 (lets tests share engines)
                fresh = FakeEngine(spec, device, int(body.get("seed", seed)), std)
                engine.load_weights(fresh.tensors.items())
                engine.weight_version = 0
                result = {}
            elif method == "repack":  # what a memory release + resume does to an engine's weight buffer
                engine.repack()
                result = {}
            elif method == "server_info":  # what the updaters read of an engine: one rank, the digest checker
                result = {"tp_size": 1, "version": "miles-fake", "weights_checker_actions": list(CHECKER_ACTIONS)}
            elif method == "dump":
                result = {
                    "weight_version": engine.weight_version,
                    "tensors": {
                        n: [
                            dtype_name(t.dtype),
                            base64.b64encode(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).decode(),
                        ]
                        for n, t in engine.tensors.items()
                    },
                }
            elif method.startswith("_") or not hasattr(receiver, method):
                return web.json_response({"error": f"no endpoint {method}"}, status=404)
            else:
                result = await getattr(receiver, method)(**body)
        except (ValueError, RuntimeError, TypeError) as exc:  # TypeError: the body's fields do not fit the method
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response(result if result is not None else {})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{method}", handle)
    app.router.add_post("/miles/{method}", handle)  # the embedded front's miles-only endpoints
    try:
        web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True, access_log=None)
    finally:
        engine.close()  # unlink the shared-memory weight segment


class EngineProcess:
    def __init__(self, proc: mp.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def spawn_engines(
    spec: TensorSpec,
    count: int,
    *,
    device: str = "cpu",
    seeds: list[int] | None = None,
    skip_tensor: dict[int, str] | None = None,
    std: float = 1.0,
    ready_timeout_s: float = 180.0,
) -> list[EngineProcess]:
    """Start `count` fake engines at once (engine i seeded with seeds[i], default i + 1) and wait until all answer.

    A CPU engine is a new process forked from multiprocessing's fork server: where the server preloads this
    module (the test suite does), it starts without importing torch again. A CUDA engine is spawned: a fork
    server that ever touched the driver would hand its children a CUDA they cannot initialise."""
    ctx = mp.get_context("forkserver" if device == "cpu" else "spawn")
    handles = []
    for i in range(count):
        port = free_port()
        skip = (skip_tensor or {}).get(i)
        proc = ctx.Process(
            target=_serve, args=(spec, port, device, seeds[i] if seeds else i + 1, skip, std), daemon=True
        )
        proc.start()
        handles.append(EngineProcess(proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + ready_timeout_s
    try:
        for h in handles:
            while not asyncio.run(_ping(h.url)):
                if not h.proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"fake engine at {h.url} did not start (exit code {h.proc.exitcode})")
                time.sleep(0.2)
    except BaseException:
        for h in handles:
            h.stop()
        raise
    return handles


@contextmanager
def fake_engines(spec: TensorSpec, count: int, **kw: Any) -> Iterator[list[HTTPEngineControl]]:
    """`count` fake engines (`spawn_engines(spec, count, **kw)`) as clients; stopped on exit, and
    checked to be gone when the block ended normally."""
    procs = spawn_engines(spec, count, **kw)
    try:
        yield [HTTPEngineControl(p.url) for p in procs]
    finally:
        for p in procs:
            p.stop()
    assert not any(p.proc.is_alive() for p in procs), "a fake engine process outlived stop()"


async def _ping(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/update_weight_version", json={"new_version": "0"}) as r,
        ):
            return r.status == 200
    except aiohttp.ClientError:
        return False


class HTTPEngineControl:
    """Async client of a fake engine's weight endpoints (same method names as EngineClient)."""

    def __init__(self, url: str, timeout_s: float = 120.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"engine@{self.url}"

    async def _post(self, method: str, payload: dict) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.post(f"{self.url}/{method}", json=payload) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{method} -> HTTP {r.status}: {body.get('error', body)}")
            return body

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(**kw: Any) -> Any:
            return await self._post(method, kw)

        return call

    async def request(
        self, method: str, endpoint: str, payload: dict | None = None, *, ok_statuses: tuple[int, ...] = (), **_: Any
    ) -> tuple[int, Any]:
        """EngineClient.request's shape: (status, parsed body); other non-2xx statuses raise."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.request(method, self.url + endpoint, json=payload or {}) as r,
        ):
            body = await r.json(content_type=None)
            if r.status >= 300 and r.status not in ok_statuses:
                raise RuntimeError(f"{endpoint} -> HTTP {r.status}: {body}")
            return r.status, body

    async def server_info(self) -> dict:
        return await self._post("server_info", {})

    async def export_weight_buffer(self, **kw: Any) -> dict:
        return await self._post("miles/export_weight_buffer", kw)

    async def install_weight_buffer(self, **kw: Any) -> None:
        await self._post("miles/install_weight_buffer", kw)

    async def dump(self) -> dict:
        return await self._post("dump", {})

    def dump_bytes(self) -> tuple[int, dict[str, bytes]]:
        """Blocking: (weight_version, {name: raw bytes}) of the engine's tensors."""
        d = asyncio.run(self.dump())
        return d["weight_version"], {n: base64.b64decode(b) for n, (_, b) in d["tensors"].items()}


class _RankCollectives:
    """One trainer thread's barrier (call it) and `all_gather(obj)`, as trainer processes get from torch.distributed."""

    def __init__(self, rank: int, barrier: threading.Barrier, slots: list[Any]) -> None:
        self.rank, self._barrier, self._slots = rank, barrier, slots

    def __call__(self) -> None:
        self._barrier.wait()

    def all_gather(self, obj: Any) -> list[Any]:
        self._slots[self.rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank read them all
        return out


def run_trainer_ranks(
    world_size: int, body: Callable[[int, Callable[[], None]], None], timeout_s: float = 120
) -> None:
    """Run `body(rank, barrier)` for each trainer rank in a thread of its own, as trainer processes would
    run it; `barrier` is what `WeightUpdater.connect` takes (and `barrier.all_gather` its `all_gather`).
    Re-raises the first rank's error (the other ranks' barrier is broken so they do not wait for it) and
    fails when a rank hangs."""
    barrier = threading.Barrier(world_size, timeout=60)
    slots: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank, _RankCollectives(rank, barrier, slots))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the calling thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a trainer rank hung for more than {timeout_s:.0f} s")
    if errors:
        raise errors[0]
