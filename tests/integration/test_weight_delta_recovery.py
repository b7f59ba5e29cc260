"""Disk-delta recovers from a refused version: engines keep serving the old weights, the next
update re-bases them, and from then on they equal the trainer's bit for bit."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from miles.config import WeightsConfig
from miles.testing.fake_engine import FakeEngine, HTTPEngineControl, fake_engines
from miles.weights.base import EngineCallError
from miles.weights.delta_updater import DiskDeltaUpdater
from miles.weights.disk_delta import version_dir

SPEC = [
    ("model.embed_tokens.weight", [64, 32], "bfloat16"),
    ("model.layers.0.mlp.up_proj.weight", [96, 32], "bfloat16"),
    ("model.norm.weight", [32], "float32"),
]
SEED = 5


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    with fake_engines(SPEC, 2, seeds=[SEED, SEED]) as controls:
        yield controls


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    """What the trainer streams for versions 1..n (v1 = the engines' startup weights)."""
    state = dict(FakeEngine(SPEC, seed=SEED).tensors)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        out.append(state)
        state = {k: (v.float() + 0.1 * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in state.items()}
    return out


def _raw(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in state.items()}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class CorruptOnPull:
    """Engine control that corrupts a published delta file of the chosen versions just before the pull."""

    def __init__(self, inner: HTTPEngineControl, published: Path, bad_versions: set[int]) -> None:
        self.inner, self.published, self.bad_versions = inner, published, bad_versions

    def __repr__(self) -> str:
        return repr(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def pull_weights(self, **kw):
        version = int(kw["target_version"])
        if version in self.bad_versions:  # runs before the first await: every engine sees the corrupt file
            self.bad_versions.discard(version)
            _flip_byte(sorted(version_dir(self.published, version).glob("*.zst"))[0])
        return await self.inner.pull_weights(**kw)


def _updater(tmp_path: Path, engines, bad_versions: set[int]) -> DiskDeltaUpdater:
    for e in engines:
        asyncio.run(e.reset(seed=SEED))
    cfg = WeightsConfig(
        update_weight_transfer_mode="disk-delta",
        update_weight_disk_dir=str(tmp_path / "delta"),
        check_weight_update_equal=True,
        weight_sync_timeout_s=30,
    )
    up = DiskDeltaUpdater(cfg)
    published = tmp_path / "delta" / "published"
    up.connect([CorruptOnPull(e, published, bad_versions) for e in engines])
    return up


def _serving(engines, version: int, state: dict[str, torch.Tensor]) -> None:
    for e in engines:
        served_version, served = e.dump_bytes()
        assert served_version == version
        assert served == _raw(state)


def test_refused_version_keeps_old_weights_and_next_update_rebases(engines, tmp_path):
    versions = _versions(5)
    up = _updater(tmp_path, engines, bad_versions={3})
    try:
        for v in (1, 2):
            up.update(versions[v - 1].items(), v)
        m3 = up.update(versions[2].items(), 3)  # its delta file is corrupted before the engines pull it
        assert m3["weight_sync/refused_engines"] == 2
        _serving(engines, 2, versions[1])  # both still serve v2, and say so
        m4 = up.update(versions[3].items(), 4)
        assert m4["weight_sync/delta_full"] == 1.0 and m4["weight_sync/refused_engines"] == 0
        _serving(engines, 4, versions[3])
        m5 = up.update(versions[4].items(), 5)  # every host holds v4 again: back to small deltas
        assert m5["weight_sync/delta_full"] == 0.0
        assert m5["weight_sync/delta_bytes_fraction"] < m4["weight_sync/delta_bytes_fraction"]
        _serving(engines, 5, versions[4])
    finally:
        up.close()


def test_one_host_refusing_holds_every_engine_back_then_both_recover(engines, tmp_path):
    versions = _versions(4)
    up = _updater(tmp_path, engines, bad_versions=set())
    try:
        for v in (1, 2):
            up.update(versions[v - 1].items(), v)
        host0 = Path(up.local_dir(0))
        index = json.loads((host0 / "index.json").read_text())
        _flip_byte(host0 / index["tensors"]["model.norm.weight"]["file"])  # engine 0's own copy rots
        m3 = up.update(versions[2].items(), 3)
        assert m3["weight_sync/refused_engines"] == 1
        assert up.host_versions == [2, 3]  # engine 1 patched its copy but did not reload it
        _serving(engines, 2, versions[1])
        up.update(versions[3].items(), 4)
        _serving(engines, 4, versions[3])
    finally:
        up.close()


def test_a_host_refusing_twice_in_a_row_raises_naming_it(engines, tmp_path):
    versions = _versions(4)
    up = _updater(tmp_path, engines, bad_versions={3, 4})
    try:
        for v in (1, 2, 3):
            up.update(versions[v - 1].items(), v)
        with pytest.raises(EngineCallError, match=r"refused two updates in a row.*engine 0 \(engine@http"):
            up.update(versions[3].items(), 4)
        _serving(engines, 2, versions[1])
    finally:
        up.close()


def test_resumed_trainer_rebases_engines_that_restarted_from_the_checkpoint(engines, tmp_path):
    """After a resume the trainer's first weights are not the engines' startup weights, and the shared
    directory still holds versions of the run before: the first update clears those, publishes its
    base in full once, and the run goes on with deltas."""
    versions = _versions(4)
    stale = version_dir(tmp_path / "delta" / "published", 4)  # the crashed run had published v4 already
    stale.mkdir(parents=True)
    (stale / "index.json").write_text(json.dumps({"version": 4, "encoding": "xor"}))
    up = _updater(tmp_path, engines, bad_versions=set())
    try:
        m3 = up.update(versions[2].items(), 3)  # resumed at v3; the engines started from v1's weights
        assert m3["weight_sync/delta_full"] == 1.0 and m3["weight_sync/refused_engines"] == 0
        _serving(engines, 3, versions[2])
        m4 = up.update(versions[3].items(), 4)  # v4 again, this time against this run's base
        assert m4["weight_sync/delta_full"] == 0.0
        _serving(engines, 4, versions[3])
    finally:
        up.close()
