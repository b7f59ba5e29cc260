"""--check-weight-update-equal catches a transport that drops or alters a tensor, naming tensor and engine."""

import asyncio

import pytest
import torch

from miles.config import WeightsConfig
from miles.testing.fake_engine import fake_engines
from miles.weights.broadcast import BroadcastUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.verify import WeightMismatchError

SPEC = [
    ("model.embed_tokens.weight", [32, 16], "bfloat16"),
    ("model.layers.0.mlp.down_proj.weight", [16, 48], "bfloat16"),
    ("model.norm.weight", [16], "float32"),
]
SKIPPED = "model.layers.0.mlp.down_proj.weight"


class SkippingBroadcast(BroadcastUpdater):
    """Fault injection: a transport that silently never sends one tensor."""

    def _transfer(self, named, version):
        return super()._transfer(((n, t) for n, t in named if n != SKIPPED), version)


class CorruptingBroadcast(BroadcastUpdater):
    """Fault injection: a transport that flips the lowest bit of one element."""

    def _transfer(self, named, version):
        def corrupt(stream):
            for n, t in stream:
                if n == "model.norm.weight":
                    t = t.clone()
                    t.view(torch.int32)[3] ^= 1
                yield n, t

        return super()._transfer(corrupt(named), version)


class SkippingDirect(DirectColocatedUpdater):
    """Fault injection: a direct colocated write that never writes one tensor into the engine's buffer."""

    def _transfer(self, named, version):
        return super()._transfer(((n, t) for n, t in named if n != SKIPPED), version)


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    with fake_engines(SPEC, 2) as controls:
        yield controls


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    return {n: torch.randn(s, generator=gen).to(getattr(torch, d)) for n, s, d in SPEC}


def _push(updater_cls, engines, check: bool = True) -> None:
    up = updater_cls(WeightsConfig(check_weight_update_equal=check, weight_sync_timeout_s=30))
    try:
        up.connect(engines)
        up.update(_weights().items(), 1)
    finally:
        up.close()


def test_correct_transport_passes_and_engines_hold_trainer_bytes(engines):
    _push(BroadcastUpdater, engines)
    for e in engines:
        _, state = e.dump_bytes()
        assert state == {n: t.view(torch.uint8).numpy().tobytes() for n, t in _weights().items()}


def test_skipped_tensor_is_caught_and_named(engines):
    with pytest.raises(WeightMismatchError) as info:
        _push(SkippingBroadcast, engines)
    msg = str(info.value)
    for e in engines:
        assert f"({e!r}): mismatched: {SKIPPED}" in msg
    # the noise really was there: without the check an engine keeps noise in that tensor
    _, state = engines[0].dump_bytes()
    assert state[SKIPPED] != _weights()[SKIPPED].view(torch.uint8).numpy().tobytes()


def test_single_bit_difference_is_caught(engines):
    with pytest.raises(WeightMismatchError, match="mismatched: model.norm.weight"):
        _push(CorruptingBroadcast, engines)


def test_without_check_a_skipped_tensor_goes_unnoticed(engines):
    asyncio.run(engines[0].reset())
    _push(SkippingBroadcast, engines, check=False)  # no error: the check is what catches it


def test_direct_colocated_write_that_skips_a_tensor_is_caught(engines):
    asyncio.run(engines[0].reset())
    with pytest.raises(WeightMismatchError, match=f"mismatched: {SKIPPED}"):
        _push(SkippingDirect, engines[:1])  # the direct path: trainer rank 0 writes into engine 0's buffer
