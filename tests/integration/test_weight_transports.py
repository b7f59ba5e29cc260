"""Every transport delivers bit-identical weights to 2 engine processes from 2 trainer ranks.

`colocated` is the direct path (the trainer writes into each engine's shared weight buffer);
`colocated-buckets` the per-bucket handoff that engines without that buffer (SGLang) still get."""

import asyncio

import pytest
import torch

from miles.config import WeightsConfig
from miles.testing.fake_engine import FakeEngine, HTTPEngineControl, fake_engines, run_trainer_ranks, spawn_engines
from miles.weights.base import EngineCallError
from miles.weights.colocated import ColocatedUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.groups import WeightSyncTimeoutError
from miles.weights.registry import make_updater
from miles.wire.ports import free_port

SPEC = [
    ("model.embed_tokens.weight", [64, 32], "bfloat16"),
    ("model.layers.0.self_attn.q_proj.weight", [32, 32], "bfloat16"),
    ("model.layers.0.mlp.up_proj.weight", [96, 32], "bfloat16"),
    ("model.norm.weight", [32], "float32"),
    ("lm_head.weight", [64, 32], "bfloat16"),
]
SEED = 3  # engines and trainer start from the same weights (disk-delta needs a common base)


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    with fake_engines(SPEC, 2, seeds=[SEED, SEED]) as controls:
        yield controls


def _versions() -> list[dict[str, torch.Tensor]]:
    """fp32 master weights for versions 1..3 (v1 = the startup weights)."""
    master = {n: t.float() for n, t in FakeEngine(SPEC, seed=SEED).tensors.items()}
    out = []
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        out.append({n: t.clone() for n, t in master.items()})
        for n in master:
            master[n] = master[n] + 0.05 * torch.randn(master[n].shape, generator=gen)
    return out


def _stream(master: dict[str, torch.Tensor]):
    # What an FSDP rank yields: the gathered full tensor cast to the engine dtype.
    for name, _, dtype in SPEC:
        yield name, master[name].to(getattr(torch, dtype))


def _run_ranks(cfg: WeightsConfig, engines, versions, *, colocate: bool = False, updater_cls=None) -> list[dict]:
    """Two trainer ranks (threads) connect, push every version, close; returns rank 0's metrics per version."""
    port = free_port()
    metrics = []

    def rank(r: int, barrier) -> None:
        up = updater_cls(cfg) if updater_cls else make_updater(cfg, colocate=colocate)
        try:
            up.connect(engines, trainer_rank=r, trainer_world_size=2, master_port=port, barrier=barrier)
            for v, master in enumerate(versions, start=1):
                m = up.update(_stream(master), v)
                if r == 0:
                    metrics.append(m)
        finally:
            up.close()

    run_trainer_ranks(2, rank)
    return metrics


@pytest.mark.parametrize("mode", ["broadcast", "p2p", "disk-delta", "colocated", "colocated-buckets"])
def test_transport_delivers_bit_identical_weights(mode, engines, tmp_path):
    for e in engines:
        asyncio.run(e.reset(seed=SEED))
    colocated = mode.startswith("colocated")
    cfg = WeightsConfig(
        update_weight_transfer_mode="broadcast" if colocated else mode,
        update_weight_buffer_size=6000,  # several buckets per update
        update_weight_disk_dir=str(tmp_path / "delta"),
        check_weight_update_equal=True,
        weight_sync_timeout_s=30,
    )
    versions = _versions()
    updater_cls = ColocatedUpdater if mode == "colocated-buckets" else None
    metrics = _run_ranks(cfg, engines, versions, colocate=colocated, updater_cls=updater_cls)
    expected = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in _stream(versions[-1])}
    for e in engines:
        version, state = e.dump_bytes()
        assert version == len(versions)
        assert state == expected
    if mode == "colocated":  # every tensor written straight into the engine's buffer, no buckets
        assert metrics[-1]["weight_sync/direct_tensors"] == len(SPEC)
        assert metrics[-1]["weight_sync/buckets"] == 0
    elif mode != "disk-delta":
        assert metrics[-1]["weight_sync/buckets"] >= 3
    else:
        assert 0 < metrics[-1]["weight_sync/delta_bytes_fraction"] < 1.5


def test_direct_colocated_refuses_a_stale_weight_buffer(engines):
    engine = engines[0]
    asyncio.run(engine.reset(seed=SEED))
    export = asyncio.run(engine.export_weight_buffer())
    asyncio.run(engine.repack())  # the engine reallocated its buffer (as after a memory release/resume)
    with pytest.raises(RuntimeError, match="StaleWeightBufferError.*push the weights again"):
        asyncio.run(engine.install_weight_buffer(generation=export["generation"], weight_version="9"))
    fresh = asyncio.run(engine.export_weight_buffer())
    assert fresh["generation"] == export["generation"] + 1
    assert fresh["buffer"]["segment"] != export["buffer"]["segment"]  # the old segment was unlinked


class _RecordingControl(HTTPEngineControl):
    """Records what each export call answered: 'full' (a buffer to map) or 'unchanged'."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.exports: list[str] = []

    async def export_weight_buffer(self, **kw) -> dict:
        assert kw.get("for_mapping") is True  # the updater maps what it asks for: on CUDA the handle comes only so
        export = await super().export_weight_buffer(**kw)
        self.exports.append("unchanged" if export.get("unchanged") else "full")
        return export


@pytest.mark.parametrize("keep_mapping", [True, False])
def test_direct_colocated_maps_each_buffer_generation_once(engines, keep_mapping):
    asyncio.run(engines[0].reset(seed=SEED))
    control = _RecordingControl(engines[0].url)
    up = DirectColocatedUpdater(WeightsConfig(weight_sync_timeout_s=30), keep_mapping=keep_mapping)
    up.connect([control])
    versions = _versions()
    try:
        for v, master in enumerate(versions[:2], start=1):
            up.update(_stream(master), v)
            assert (up._mapped is not None) == keep_mapping
        asyncio.run(engines[0].repack())  # a memory release + resume: a new buffer, a new generation
        up.update(_stream(versions[2]), 3)
    finally:
        up.close()
    expected = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in _stream(versions[2])}
    assert engines[0].dump_bytes() == (3, expected)  # written into the new buffer, not the old mapping
    # kept: the second update read the engine's generation word and made no export call at all
    assert control.exports == (["full", "full"] if keep_mapping else ["full"] * 3)
    assert up._mapped is None  # close() unmapped


def test_direct_colocated_refuses_a_wrong_shape(engines):
    asyncio.run(engines[0].reset(seed=SEED))
    up = DirectColocatedUpdater(WeightsConfig(weight_sync_timeout_s=30))
    up.connect(engines[:1])
    try:
        name, shape, _ = SPEC[1]
        with pytest.raises(ValueError, match=f"shape mismatch for '{name}'"):
            up.update([(name, torch.zeros(shape[0] + 1, shape[1], dtype=torch.bfloat16))], 1)
    finally:
        up.close()
    version, _ = engines[0].dump_bytes()
    assert version == 0  # nothing was installed


def test_dead_engine_is_named_on_the_direct_colocated_path():
    [proc] = spawn_engines(SPEC, 1, seeds=[SEED])
    up = DirectColocatedUpdater(WeightsConfig(weight_sync_timeout_s=8))
    try:
        up.connect([HTTPEngineControl(proc.url, timeout_s=10)])
        up.update(_stream(_versions()[0]), 1)  # maps the engine's buffer and keeps it
        proc.stop()
        with pytest.raises(
            EngineCallError, match=f"engine 0 .*{proc.url.split('//')[1]}.*(export|install)_weight_buffer"
        ):
            up.update(_stream(_versions()[1]), 2)
    finally:
        up.close()
        proc.stop()


def test_dead_engine_is_named_not_hung(tmp_path):
    procs = spawn_engines(SPEC, 2, seeds=[SEED, SEED])
    try:
        controls = [HTTPEngineControl(p.url, timeout_s=10) for p in procs]
        cfg = WeightsConfig(weight_sync_timeout_s=8, update_weight_buffer_size=6000)
        up = make_updater(cfg)
        up.connect(controls)
        procs[1].stop()  # dies between connect and update
        with pytest.raises((WeightSyncTimeoutError, EngineCallError), match=procs[1].url.split("//")[1]):
            up.update(_stream(_versions()[0]), 1)
        up.close()
    finally:
        for p in procs:
            p.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA IPC handoff)")
def test_colocated_cuda_ipc_delivers_bit_identical_weights():
    [proc] = spawn_engines(SPEC, 1, device="cuda", seeds=[SEED])
    try:
        control = HTTPEngineControl(proc.url)
        up = make_updater(WeightsConfig(check_weight_update_equal=True, update_weight_buffer_size=6000), colocate=True)
        up.connect([control])
        master = {n: t.cuda() for n, t in _stream(_versions()[-1])}
        up.update(master.items(), 1)
        up.close()
        version, state = control.dump_bytes()
        assert version == 1
        assert state == {n: t.cpu().view(torch.uint8).numpy().tobytes() for n, t in master.items()}
    finally:
        proc.stop()
