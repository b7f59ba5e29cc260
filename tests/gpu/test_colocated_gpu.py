"""Colocated CUDA IPC handoff: engine processes on the trainer's GPU receive bit-identical weights,
and a finished update leaves no trainer memory behind (the engine released every mapping).

Both paths: the per-bucket handoff (ColocatedUpdater) and the direct one (the trainer writes into
the engine's shared weight buffer), including the embedded engine's release/resume around it."""

import asyncio
import multiprocessing as mp
import time

import pytest
import torch

from miles.config import WeightsConfig
from miles.engines.client import EngineClient
from miles.testing.fake_engine import fake_engines, run_trainer_ranks
from miles.weights import verify
from miles.weights.colocated import ColocatedUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA IPC)")]

SPEC = [
    ("model.embed_tokens.weight", [512, 64], "bfloat16"),  # 64 KiB: larger than a bucket, travels alone
    ("model.layers.0.self_attn.q_proj.weight", [64, 64], "bfloat16"),
    ("model.layers.0.self_attn.q_proj.bias", [7], "bfloat16"),  # 14 bytes: odd offsets without alignment
    ("model.layers.0.mlp.up_proj.weight", [96, 64], "bfloat16"),
    ("model.norm.weight", [33], "float32"),
    ("lm_head.weight", [64, 64], "bfloat16"),
]
BUCKET_BYTES = 16 * 1024  # several buckets per update


@pytest.fixture(scope="module")
def engines():
    with fake_engines(SPEC, 2, device="cuda", seeds=[1, 2]) as controls:
        yield controls


def _fresh(version: int) -> dict[str, torch.Tensor]:
    """What a trainer yields: new device tensors every update, some of them non-contiguous views."""
    gen = torch.Generator(device="cuda").manual_seed(100 + version)
    out = {}
    for name, shape, dtype in SPEC:
        if len(shape) == 2:  # a transposed view: the handoff must pack its logical layout
            t = torch.randn(shape[::-1], generator=gen, device="cuda").t()
        else:
            t = torch.randn(shape, generator=gen, device="cuda")
        out[name] = t.to(getattr(torch, dtype))
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _updater(check: bool, cls: type = ColocatedUpdater) -> ColocatedUpdater:
    return cls(
        WeightsConfig(
            update_weight_buffer_size=BUCKET_BYTES, check_weight_update_equal=check, weight_sync_timeout_s=60
        )
    )


@pytest.mark.parametrize("cls", [ColocatedUpdater, DirectColocatedUpdater])
def test_versions_arrive_bit_identical_and_no_trainer_memory_is_left(engines, cls):
    asyncio.run(engines[0].reset(seed=1))
    up = _updater(check=True, cls=cls)  # the first update also runs the noise-then-digest check
    up.connect(engines[:1])
    try:
        for version in (1, 2, 3):
            master = _fresh(version)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            metrics = up.update(master.items(), version)
            torch.cuda.synchronize()
            # Every staging buffer was freed: the engine dropped its mapping before it answered.
            assert torch.cuda.memory_allocated() == before
            if cls is ColocatedUpdater:
                assert metrics["weight_sync/buckets"] >= 3
            else:
                assert metrics["weight_sync/direct_tensors"] == len(SPEC)
            served_version, served = engines[0].dump_bytes()
            assert served_version == version
            assert served == {n: _raw(t) for n, t in master.items()}
    finally:
        up.close()


@pytest.mark.parametrize("cls", [ColocatedUpdater, DirectColocatedUpdater])
def test_two_trainer_ranks_feed_two_engines_on_one_gpu(engines, cls):
    masters = [_fresh(10), _fresh(11)]

    def rank(r: int, barrier) -> None:
        up = _updater(check=False, cls=cls)
        try:
            up.connect(engines, trainer_rank=r, trainer_world_size=2, barrier=barrier)
            up.update(masters[r].items(), 7)
        finally:
            up.close()

    run_trainer_ranks(2, rank)
    for engine, master in zip(engines, masters, strict=True):
        served_version, served = engine.dump_bytes()
        assert served_version == 7
        assert served == {n: _raw(t) for n, t in master.items()}


# -- the embedded engine: release frees its weight buffer, resume repacks it, updates keep working ---


def _serve_embedded(model_dir: str, port: int, quantization: str | None = None) -> None:
    from aiohttp import web

    from miles.engines.embedded.engine import EmbeddedEngine
    from miles.engines.http_front import build_app

    async def main() -> None:
        engine = EmbeddedEngine(model_dir, device="cuda", dtype="bfloat16", quantization=quantization)
        await engine.start()
        app = build_app(engine)

        async def memory(_: web.Request) -> web.Response:
            torch.cuda.synchronize()
            return web.json_response({"allocated": torch.cuda.memory_allocated()})

        app.router.add_get("/test/memory_allocated", memory)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_embedded_engine_release_frees_the_buffer_and_resume_takes_updates(tmp_path, quantization):
    """With FP8 serving the trainer quantizes each weight per block and writes values and scales; the check
    then compares within the quantization error."""
    from miles.models.tiny import make_tiny_model
    from miles.wire.ports import free_port

    model_dir = make_tiny_model(str(tmp_path / "qwen2"), hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024)
    port = free_port()
    proc = mp.get_context("spawn").Process(target=_serve_embedded, args=(model_dir, port, quantization), daemon=True)
    proc.start()
    client = EngineClient(f"http://127.0.0.1:{port}", max_retries=0)
    try:
        deadline = time.monotonic() + 180
        while not asyncio.run(client.health(generate=False, timeout_s=5)):
            assert proc.is_alive() and time.monotonic() < deadline, "the embedded engine did not start"
            time.sleep(0.5)
        asyncio.run(client.pause_generation("retract"))
        export = asyncio.run(client.request("POST", "/miles/export_weight_buffer", {}))[1]
        scales = {n + "_scale_inv" for n in (export.get("quantized") or {}).get("names", [])}
        assert bool(scales) == (quantization == "fp8")
        names = {n: e["shape"] for n, e in export["tensors"].items() if n not in scales}

        def push(version: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(version)
            master = {n: torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16) for n, s in names.items()}
            up = DirectColocatedUpdater(
                WeightsConfig(
                    check_weight_update_equal=True,
                    check_weight_update_allow_quant_error=bool(scales),
                    weight_sync_timeout_s=60,
                )
            )
            up.connect([client])
            try:
                up.update(master.items(), version)
            finally:
                up.close()
            return master

        def allocated() -> int:
            return asyncio.run(client.request("GET", "/test/memory_allocated"))[1]["allocated"]

        weight_bytes = export["nbytes"]
        for cycle in range(3):  # each release after a push (the trainer mapped, wrote and closed) frees the buffer
            push(1 + cycle)
            before = allocated()
            asyncio.run(client.release_memory_occupation(["weights"]))  # the weights alone: the KV cache's bytes
            assert allocated() <= before - weight_bytes, cycle  # would hide a buffer kept in torch's IPC limbo
            asyncio.run(client.release_memory_occupation(["kv_cache"]))
            asyncio.run(client.resume_memory_occupation(["weights", "kv_cache"]))
        master = push(4)  # a new generation: the updater fetches the fresh export
        assert asyncio.run(client.get_weight_version()) == 4
        if not scales:  # bit for bit (the FP8 pushes were each checked within the quantization error)
            digests = {n: verify.tensor_digest(t, "xxh3-128") for n, t in master.items()}
            result = asyncio.run(client.weights_checker(action="compare", digests=digests, digest="xxh3-128"))
            assert not (result["mismatched"] or result["not_sent"] or result["missing"]), result
        asyncio.run(client.continue_generation())
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- the install call waits for the trainer's copies (inter-process CUDA event) ---------------------


def _wait_in_child(handle: str, conn) -> None:
    from miles.weights.arena import wait_for_writer

    wait_for_writer(handle, "cuda:0")  # opens (and caches) the event; its first record is long done
    conn.send("ready")
    conn.recv()  # "go": the trainer re-recorded the event behind a long kernel
    start = time.perf_counter()
    wait_for_writer(handle, "cuda:0")  # the engine's stream now waits for the trainer's kernel ...
    returned = time.perf_counter() - start
    done = torch.ones(1, device="cuda:0") * 2  # ... so engine work queued now runs after it
    torch.cuda.current_stream().synchronize()
    conn.send((returned, time.perf_counter() - start, float(done)))


def test_engine_work_is_ordered_after_the_newest_record_of_the_trainers_event():
    from miles.weights.tensor_ipc import b64

    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_wait_in_child, args=(b64(event.ipc_handle()), child), daemon=True)
    proc.start()
    try:
        assert parent.poll(120) and parent.recv() == "ready"
        torch.cuda._sleep(int(2e9))  # stands in for copies still running (about a second)
        event.record()
        parent.send("go")
        start = time.perf_counter()
        torch.cuda.synchronize()
        busy = time.perf_counter() - start
        assert parent.poll(60), "the engine side did not answer"
        returned, ordered, value = parent.recv()
        assert busy > 0.3, f"the kernel ran only {busy:.2f} s; the check needs a longer one"
        assert returned < 0.5 * busy, f"the engine side blocked {returned:.2f} s (a stream wait should not)"
        assert ordered >= 0.8 * busy, f"engine work finished after {ordered:.2f} s of a {busy:.2f} s trainer kernel"
        assert value == 2.0
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_trainer_gives_its_cached_memory_back_before_the_engines_resume():
    """What training leaves in the caching allocator (a micro-batch's activations, freed but cached) goes back
    to the driver when the controller asks, before colocated engines take their memory back: a 1.5B recipe
    with offload ran out of memory at the engine's resume while the trainer held 110 GiB of cache."""
    from miles.workers.trainer_worker import TrainerWorker

    torch.cuda.empty_cache()
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, freed into the cache
    del x
    assert torch.cuda.memory_reserved() >= 1 << 30
    in_use_gb = torch.cuda.memory_allocated() / 2**30  # what earlier tests of this process still hold
    free_before, _ = torch.cuda.mem_get_info()
    out = TrainerWorker.release_cached_memory(None)
    free_after, _ = torch.cuda.mem_get_info()
    assert out["released_gb"] >= 0.99 and out["reserved_gb"] - in_use_gb < 0.5, (out, in_use_gb)
    assert free_after - free_before >= 0.99 * (1 << 30)  # the driver has it again, for another process
