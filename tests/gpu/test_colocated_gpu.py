"""Colocated CUDA IPC handoff: engine processes on the trainer's GPU receive bit-identical weights,
and a finished update leaves no trainer memory behind (the engine released every mapping)."""

import threading

import pytest
import torch

from miles.config_sections import WeightsConfig
from miles.weights.colocated import ColocatedUpdater
from miles.weights.fake_engine import HTTPEngineControl, spawn_engines

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
    procs = spawn_engines(SPEC, 2, device="cuda", seeds=[1, 2])
    yield [HTTPEngineControl(p.url) for p in procs]
    for p in procs:
        p.stop()
    assert not any(p.proc.is_alive() for p in procs)


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


def _updater(check: bool) -> ColocatedUpdater:
    return ColocatedUpdater(
        WeightsConfig(
            update_weight_buffer_size=BUCKET_BYTES, check_weight_update_equal=check, weight_sync_timeout_s=60
        )
    )


def test_versions_arrive_bit_identical_and_no_trainer_memory_is_left(engines):
    up = _updater(check=True)  # the first update also runs the noise-then-digest check
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
            assert metrics["weight_sync/buckets"] >= 3
            served_version, served = engines[0].dump_bytes()
            assert served_version == version
            assert served == {n: _raw(t) for n, t in master.items()}
    finally:
        up.close()


def test_two_trainer_ranks_feed_two_engines_on_one_gpu(engines):
    barrier = threading.Barrier(2, timeout=60)
    masters = [_fresh(10), _fresh(11)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        up = _updater(check=False)
        try:
            up.connect(engines, trainer_rank=r, trainer_world_size=2, barrier=barrier.wait)
            up.update(masters[r].items(), 7)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            up.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer rank hung"
    if errors:
        raise errors[0]
    for engine, master in zip(engines, masters, strict=True):
        served_version, served = engine.dump_bytes()
        assert served_version == 7
        assert served == {n: _raw(t) for n, t in master.items()}
