"""The `async` section: fully asynchronous RL: the data buffer, staleness, unused samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import MAX_SAMPLES_PER_STEP, option


@dataclass
class AsyncConfig:
    """Fully asynchronous RL: the data buffer, staleness, unused samples."""

    fully_async: bool = option(False, "fully asynchronous RL (disaggregated only)")
    async_max_concurrent_samples: int | None = option(
        None,
        "trajectories kept generating",
        range=f"[1, {MAX_SAMPLES_PER_STEP}]",
        unit="trajectories generating at once",
    )
    async_data_buffer_capacity_factor: float = option(
        2.0,
        "buffer capacity = factor x rollout_batch_size groups",
        range="(0, 1024]",
        unit="a multiple of --rollout-batch-size",
    )
    custom_async_data_buffer_path: str | None = option(None, "import path of a custom data buffer")
    max_weight_staleness: int | None = option(
        None, "drop (or pace) groups staler than this", range="[0, inf)", unit="weight versions"
    )
    async_unused_samples_handler: Literal["retry", "drop"] = option("drop", "{choices}")
    async_staleness_policy: Literal["drop", "pace"] = option("drop", "{choices}")
