"""Adapter-only weight sync for LoRA runs: the engines keep their base, only the adapter moves.

Each update hands the whole adapter to every engine in one call (SGLang's LoRA endpoints), so an
engine swaps from one adapter to the next at once, never serving half of each:
- `LoraBroadcastUpdater` (`--update-weight-transfer-mode broadcast`): the trainer's rank 0 posts
  `load_lora_adapter_from_distributed {lora_name, config_dict, names, dtypes, shapes, group_name}`
  to every engine and broadcasts the tensors over the weight-sync group (as `BroadcastUpdater`
  does for a bucket);
- `LoraColocatedUpdater` (`--colocate`): trainer rank i packs the adapter into one flat buffer on
  its device and posts `load_lora_adapter_from_tensors {lora_name, config_dict, serialized_tensors}`
  to engine i (the handoff of colocated.py).
The other transports (p2p, disk-delta) write into full weight tensors and carry no adapter; they are
refused with LoRA at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from miles.config import WeightsConfig
from miles.weights.base import WeightUpdater
from miles.weights.broadcast import BroadcastUpdater, raise_with_engine_errors
from miles.weights.bucket import NamedTensor, bucket_meta, iter_buckets
from miles.weights.colocated import ColocatedUpdater
from miles.weights.groups import WeightSyncTimeoutError
from miles.weights.tensor_ipc import pack

logger = logging.getLogger(__name__)

LORA_NAME = "miles_lora"  # the adapter's name on the engines (SGLang's `lora_name`)
# Vanilla SGLang (0.5.23) has no load_lora_adapter_from_distributed and applies an adapter only to requests
# that name it: the adapter paths need the embedded engine (or Miles' SGLang fork), probed on connect.
FORK_ENDPOINT = "/load_lora_adapter_from_distributed"
NEEDS_FORK = (
    "LoRA adapter sync needs the embedded engine (it serves the adapter to every request) or Miles' SGLang "
    "fork; vanilla SGLang has no load_lora_adapter_from_distributed; use --engine embedded for LoRA runs"
)


def whole_adapter(named: Iterable[NamedTensor]) -> list[NamedTensor]:
    """The stream as one bucket (names checked unique, tensors contiguous): an adapter travels whole."""
    buckets = list(iter_buckets(named, bucket_bytes=2**62))
    if not buckets:
        raise ValueError("the trainer yielded no adapter tensors; is LoRA on in the trainer?")
    return buckets[0]


class LoraBroadcastUpdater(BroadcastUpdater):
    mode = "broadcast"

    def __init__(self, cfg: WeightsConfig | None = None, *, adapter_config: dict, lora_name: str) -> None:
        super().__init__(cfg)
        self.adapter_config = adapter_config
        self.lora_name = lora_name

    def _probe_engines(self) -> None:
        super()._probe_engines()
        self._require_endpoint(FORK_ENDPOINT, NEEDS_FORK)

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_sender:
            for _ in named:  # take part in the gathers that produce the stream
                pass
            return {}
        assert self.group is not None
        adapter = whole_adapter(named)
        meta = bucket_meta(adapter)
        payload = {
            "lora_name": self.lora_name,
            "config_dict": self.adapter_config,
            "names": meta.names,
            "dtypes": meta.dtypes,
            "shapes": meta.shapes,
            "group_name": self.group_name,
            "weight_version": str(version),
        }
        fut = self._start_engines("load_lora_adapter_from_distributed", lambda i: payload)
        tensors = [t if t.device == self.group.device else t.to(self.group.device) for _, t in adapter]
        works = self.group.broadcast(tensors, src=0)
        try:
            for name, work in zip(meta.names, works, strict=True):
                self.group.wait(work, f"broadcast of {name!r}")
        except WeightSyncTimeoutError as exc:
            raise_with_engine_errors(exc, fut, self, "load_lora_adapter_from_distributed")
        self._wait_engines(fut, "load_lora_adapter_from_distributed")
        return {"weight_sync/buckets": 1.0}


class LoraColocatedUpdater(ColocatedUpdater):
    mode = "colocated"

    def __init__(self, cfg: WeightsConfig | None = None, *, adapter_config: dict, lora_name: str) -> None:
        super().__init__(cfg)
        self.adapter_config = adapter_config
        self.lora_name = lora_name

    def _probe_engines(self) -> None:
        super()._probe_engines()
        self._require_endpoint(FORK_ENDPOINT, NEEDS_FORK)

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_sender:
            for _ in named:
                pass
            return {}
        packed = pack(whole_adapter(named))
        try:
            self._run_engines(
                "load_lora_adapter_from_tensors",
                lambda i: {
                    "lora_name": self.lora_name,
                    "config_dict": self.adapter_config,
                    "serialized_tensors": packed.payload,  # [(name, tensor), ...] as update_weights_from_tensor's
                    "weight_version": str(version),
                },
                [self.trainer_rank],
            )
        finally:
            packed.release()
        return {"weight_sync/buckets": 1.0}


def make_lora_updater(
    cfg: WeightsConfig, *, colocate: bool, adapter_config: dict, lora_name: str = LORA_NAME
) -> WeightUpdater:
    """The adapter updater for the run's transport; ValueError for one that cannot carry an adapter."""
    if colocate:
        return LoraColocatedUpdater(cfg, adapter_config=adapter_config, lora_name=lora_name)
    if cfg.update_weight_transfer_mode == "broadcast":
        return LoraBroadcastUpdater(cfg, adapter_config=adapter_config, lora_name=lora_name)
    raise ValueError(
        f"--update-weight-transfer-mode={cfg.update_weight_transfer_mode} does not carry LoRA "
        "adapters; use broadcast (the default) or --colocate"
    )
