import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.testing.fake_engine import FakeEngine
from miles.weights.disk_delta import DeltaPublisher, DeltaRefusedError, apply_delta, encode_delta, version_dir
from miles.weights.receiver import MATERIALISE_BASE, WeightReceiver

SPEC = [
    ("model.embed_tokens.weight", [16, 8], "bfloat16"),
    ("model.norm.weight", [8], "float32"),
    ("lm_head.weight", [16, 8], "bfloat16"),
]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Host:
    """One engine host: a fake engine, its receiver and its local copy directory."""

    def __init__(self, tmp: Path, seed: int = 3) -> None:
        self.engine = FakeEngine(SPEC, seed=seed)
        self.receiver = WeightReceiver(self.engine)
        self.local = str(tmp / "host")
        self.source = str(tmp / "published")
        asyncio.run(self.receiver.pull_weights(self.local, self.source, MATERIALISE_BASE))

    def update(self, version: int) -> None:
        answer = asyncio.run(self.receiver.pull_weights(self.local, self.source, version))
        if answer.get("refused"):  # the copy is unchanged; the updater would not reload
            raise DeltaRefusedError(answer["message"])
        assert answer["version"] == version
        asyncio.run(self.receiver.update_weights_from_disk(self.local, weight_version=str(version)))

    def state(self) -> dict[str, bytes]:
        return {n: _raw(t) for n, t in self.engine.named_weights()}


def _trainer_versions(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Version 1 = the engines' startup weights; each later version changes one row of two tensors."""
    base = FakeEngine(SPEC, seed=seed).tensors
    versions = [{k: v.clone() for k, v in base.items()}]
    for i in range(1, n):
        nxt = {k: v.clone() for k, v in versions[-1].items()}
        nxt["model.embed_tokens.weight"][i] += 0.5
        nxt["model.norm.weight"][i % 8] = float(i)
        versions.append(nxt)
    return versions


@pytest.fixture(params=["xor", "overwrite"])
def setup(request, tmp_path):
    host = Host(tmp_path)
    pub = DeltaPublisher(tmp_path / "published", encoding=request.param)
    versions = _trainer_versions(4)
    pub.publish(versions[0].items(), 1)
    host.update(1)
    return host, pub, versions, request.param


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_codec_roundtrip_against_numpy(encoding):
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 1000, dtype=np.uint8)
    new = old.copy()
    new[[3, 500, 999]] ^= 0x5A
    payload = encode_delta(old, new, encoding)
    buf = old.copy()
    apply_delta(buf, payload, encoding)
    assert np.array_equal(buf, new)
    assert encode_delta(old, old.copy(), encoding) is None  # unchanged tensors write nothing


def test_versions_apply_bit_exact_and_only_changed_tensors_are_written(setup, tmp_path):
    host, pub, versions, _ = setup
    for v in (2, 3):
        stats = pub.publish(versions[v - 1].items(), v)
        assert stats.changed_tensors == 2  # lm_head never changes
        files = sorted(p.name for p in version_dir(tmp_path / "published", v).iterdir())
        assert files == ["index.json", "t00000.zst", "t00001.zst"]
        host.update(v)
        assert host.state() == {n: _raw(t) for n, t in versions[v - 1].items()}
        assert host.engine.weight_version == v
    index = json.loads((version_dir(tmp_path / "published", 3) / "index.json").read_text())
    assert (index["version"], index["base_version"], index["digest"]) == (3, 2, "xxh3-128")


def _refused_keeps_old(host: Host, version: int, match: str) -> None:
    before, old_version = host.state(), host.engine.weight_version
    with pytest.raises(DeltaRefusedError, match=match):
        host.update(version)
    assert host.state() == before and host.engine.weight_version == old_version


def test_corrupted_delta_file_is_refused(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    f = version_dir(tmp_path / "published", 2) / "t00000.zst"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    _refused_keeps_old(host, 2, "corrupt|digest")


def test_wrong_base_version_is_refused(setup):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    pub.publish(versions[2].items(), 3)  # base v2; the host still holds v1
    _refused_keeps_old(host, 3, "applies to base v2, but this host holds v1")


def test_half_written_version_is_refused(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    (version_dir(tmp_path / "published", 2) / "index.json").unlink()  # crashed before the index was written
    _refused_keeps_old(host, 2, "index.json is missing")


def test_missing_delta_file_is_refused(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    (version_dir(tmp_path / "published", 2) / "t00001.zst").unlink()
    _refused_keeps_old(host, 2, "missing")


def test_reapplying_a_version(setup):
    host, pub, versions, encoding = setup
    pub.publish(versions[1].items(), 2)
    host.update(2)
    expected = {n: _raw(t) for n, t in versions[1].items()}
    if encoding == "xor":
        _refused_keeps_old(host, 2, "already applied")
    else:
        host.update(2)  # idempotent: a retry does no harm
    assert host.state() == expected


def test_engine_not_starting_from_trainer_base_is_refused(tmp_path):
    host = Host(tmp_path, seed=99)
    pub = DeltaPublisher(tmp_path / "published")
    pub.publish(_trainer_versions(1)[0].items(), 1)
    _refused_keeps_old(host, 1, "startup weights differ")


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_full_rebase_recovers_a_host_that_refused(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    _corrupt(version_dir(tmp_path / "published", 2) / "t00000.zst")
    _refused_keeps_old(host, 2, "corrupt|digest")
    stats = pub.publish(versions[2].items(), 3, full=True)  # the host holds v1, not the base v2
    assert stats.changed_tensors == len(SPEC) and stats.base_version is None
    index = json.loads((version_dir(tmp_path / "published", 3) / "index.json").read_text())
    assert (index["encoding"], index["base_version"]) == ("full", None)
    host.update(3)
    assert host.state() == {n: _raw(t) for n, t in versions[2].items()}
    assert host.engine.weight_version == 3
    host.update(3)  # whole tensors: applying the re-base again changes nothing
    assert host.state() == {n: _raw(t) for n, t in versions[2].items()}
    pub.publish(versions[3].items(), 4)  # back to deltas against v3, which the host now holds
    host.update(4)
    assert host.state() == {n: _raw(t) for n, t in versions[3].items()}


def test_full_rebase_also_repairs_a_corrupted_host_copy(setup, tmp_path):
    host, pub, versions, _ = setup
    local = json.loads((Path(host.local) / "index.json").read_text())
    _corrupt(Path(host.local) / local["tensors"]["model.embed_tokens.weight"]["file"])
    pub.publish(versions[1].items(), 2)
    _refused_keeps_old(host, 2, "digest of the patched tensor does not match")
    pub.publish(versions[2].items(), 3, full=True)
    host.update(3)
    assert host.state() == {n: _raw(t) for n, t in versions[2].items()}


def test_corrupt_full_rebase_is_refused(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2, full=True)
    _corrupt(version_dir(tmp_path / "published", 2) / "t00002.zst")
    _refused_keeps_old(host, 2, "corrupt|digest")


def test_refusal_answer_names_the_version_held_and_reload_cannot_skip_it(setup, tmp_path):
    host, pub, versions, _ = setup
    pub.publish(versions[1].items(), 2)
    pub.publish(versions[2].items(), 3)
    answer = asyncio.run(host.receiver.pull_weights(host.local, host.source, 3))
    assert answer["refused"] and answer["success"] is False and answer["version"] == 1
    assert "applies to base v2, but this host holds v1" in answer["message"]
    with pytest.raises(ValueError, match="holds v1, not v3"):
        asyncio.run(host.receiver.update_weights_from_disk(host.local, weight_version="3"))
    assert host.engine.weight_version == 1


def test_a_host_still_at_its_startup_weights_takes_a_full_rebase(tmp_path):
    host = Host(tmp_path, seed=99)  # started from other weights: it refuses the trainer's base...
    pub = DeltaPublisher(tmp_path / "published")
    versions = _trainer_versions(2)
    pub.publish(versions[0].items(), 1)
    _refused_keeps_old(host, 1, "startup weights differ")
    pub.publish(versions[1].items(), 2, full=True)  # ...but a re-base applies at any version
    host.update(2)
    assert host.state() == {n: _raw(t) for n, t in versions[1].items()}
