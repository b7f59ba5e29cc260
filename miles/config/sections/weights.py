"""The `weights` section: weight transfer from the trainer to the engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import option


@dataclass
class WeightsConfig:
    """Weight transfer from the trainer to the engines."""

    update_weight_transfer_mode: Literal["broadcast", "p2p", "disk-delta"] = option("broadcast", "{choices}")
    update_weight_buffer_size: int = option(
        512 * 1024**2, "bucket size in bytes", range="[1, inf)", unit="bytes; also bounded by host memory"
    )
    update_weights_interval: int = option(
        1,
        "push weights every N rollout steps (sync loop; also before every eval and after the last step)",
        range="[1, inf)",
        unit="rollout steps",
    )
    update_weight_disk_dir: str | None = option(None, "shared directory for disk-delta versions")
    update_weight_delta_encoding: Literal["xor", "overwrite"] = option("xor", "{choices}")
    update_weight_digest: Literal["xxh3-128", "blake2b", "adler32"] = option(
        "xxh3-128", "per-tensor digest: {choices}"
    )
    pause_generation_mode: Literal["abort", "in_place", "retract"] = option("retract", "{choices}")
    check_weight_update_equal: bool = option(
        False, "verify every engine tensor against the trainer after the first update"
    )
    # FP8 serving (miles/engines/embedded/fp8.py)
    check_weight_update_allow_quant_error: bool = option(
        False,
        "with --check-weight-update-equal: compare sampled values within each engine's quantization error (FP8 engines) instead of bytes",
    )
    weight_sync_timeout_s: float = option(
        300.0, "timeout of every rendezvous/collective of the weight path", range="(0, inf)", unit="seconds"
    )
