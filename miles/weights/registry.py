"""`--update-weight-transfer-mode` -> the trainer-side updater that moves the weights.

The one module that imports every transport; each transport imports only `miles.weights.base`
(and the transport it extends). A colocated run (`--colocate`) hands the weights over locally
whatever the mode: engines with the shared weight buffer get it copied in place, others a
per-bucket handoff (`colocated_direct.py`).
"""

from __future__ import annotations

from miles.config import WeightsConfig
from miles.weights.base import WeightUpdater
from miles.weights.broadcast import BroadcastUpdater
from miles.weights.colocated_direct import DirectColocatedUpdater
from miles.weights.delta_updater import DiskDeltaUpdater
from miles.weights.lora import make_lora_updater
from miles.weights.p2p import P2PUpdater

UPDATERS: dict[str, type[WeightUpdater]] = {cls.mode: cls for cls in (BroadcastUpdater, P2PUpdater, DiskDeltaUpdater)}


def make_updater(
    cfg: WeightsConfig, *, colocate: bool = False, keep_mapping: bool = True, lora_config: dict | None = None
) -> WeightUpdater:
    """The updater for `cfg.update_weight_transfer_mode` (`keep_mapping`: a colocated trainer keeps the
    engine's weight buffer mapped between updates, see colocated_direct.py). `lora_config` (a LoRA run's
    adapter config): the updater moves the adapter only (lora.py)."""
    mode = cfg.update_weight_transfer_mode
    if lora_config is not None:
        return make_lora_updater(cfg, colocate=colocate, adapter_config=lora_config)
    if colocate:
        if mode == "disk-delta":
            raise ValueError(
                "disk-delta cannot be combined with --colocate; use broadcast (the default) or drop --colocate"
            )
        return DirectColocatedUpdater(cfg, keep_mapping=keep_mapping)
    cls = UPDATERS.get(mode)
    if cls is None:
        raise ValueError(f"--update-weight-transfer-mode={mode!r}; use one of {sorted(UPDATERS)}")
    return cls(cfg)
