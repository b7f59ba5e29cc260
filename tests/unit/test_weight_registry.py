"""`--update-weight-transfer-mode` resolves through `miles.weights.registry` to the transport it names."""

from __future__ import annotations

import pytest

from miles.config import ENUM_CHOICES, WeightsConfig
from miles.weights.broadcast import BroadcastUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.delta_updater import DiskDeltaUpdater
from miles.weights.p2p import P2PUpdater
from miles.weights.registry import UPDATERS, make_updater


def test_the_flag_accepts_exactly_the_registered_transports() -> None:
    assert sorted(UPDATERS) == sorted(ENUM_CHOICES["update_weight_transfer_mode"])


@pytest.mark.parametrize(
    ("mode", "cls"), [("broadcast", BroadcastUpdater), ("p2p", P2PUpdater), ("disk-delta", DiskDeltaUpdater)]
)
def test_each_mode_builds_its_transport(mode: str, cls: type, tmp_path) -> None:
    cfg = WeightsConfig(update_weight_transfer_mode=mode, update_weight_disk_dir=str(tmp_path))
    updater = make_updater(cfg)
    assert type(updater) is cls and updater.mode == mode


def test_colocated_runs_hand_over_locally_whatever_the_group_mode() -> None:
    for mode in ("broadcast", "p2p"):
        updater = make_updater(WeightsConfig(update_weight_transfer_mode=mode), colocate=True, keep_mapping=False)
        assert type(updater) is DirectColocatedUpdater
        updater.close()


def test_refusals_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="disk-delta cannot be combined with --colocate"):
        make_updater(WeightsConfig(update_weight_transfer_mode="disk-delta"), colocate=True)
    with pytest.raises(ValueError, match=r"'nccl'; use one of \['broadcast', 'disk-delta', 'p2p'\]"):
        make_updater(WeightsConfig(update_weight_transfer_mode="nccl"))
