"""Colocated handoff: trainer and engine share a device, so tensors change hands without a network.

Each bucket goes to the engine as SGLang's `/update_weights_from_tensor` payload: views of one flat
buffer the trainer packs and shares by handle (miles/weights/tensor_ipc.py holds the format).

Engines of several GPUs (`--rollout-num-gpus-per-engine` k > 1): engine i shares the GPUs of
trainer ranks `k*i .. k*i+k-1` (miles/controller/placement.py), and TP rank r of the engine maps
the buffer of trainer rank `k*i + r`. Every rank packs the bucket on its own GPU, the ranks
exchange their payloads (`all_gather`), and the engine's first rank posts the k strings in
TP-rank order; every rank keeps its buffer until the engine answered (a trainer barrier).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from miles.weights.base import EngineCallError, EngineUnsupportedError, WeightUpdater, group_layout
from miles.weights.bucket import NamedTensor
from miles.weights.tensor_ipc import PackedBucket, pack

logger = logging.getLogger(__name__)


def colocated_layout(engine_gpus: list[int]) -> dict[int, tuple[int, int]]:
    """Trainer rank -> (engine, TP rank of the engine) it hands its buckets to: engine i of k GPUs runs on the
    GPUs of trainer ranks sum(k of engines before i) onwards (miles/controller/placement.py)."""
    _, offsets = group_layout(engine_gpus, first_rank=0)
    return {off + r: (i, r) for i, off in enumerate(offsets) for r in range(engine_gpus[i])}


class ColocatedUpdater(WeightUpdater):
    """Hands each bucket to the engine on the same device. Engine i of k GPUs is served by trainer ranks
    `offset_i .. offset_i + k - 1` (offset_i: the GPUs of engines 0..i-1), one per TP rank of the engine."""

    mode = "colocated"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.serves: dict[int, tuple[int, int]] = {}  # trainer rank -> (engine, the engine's TP rank)
        self.gpus: dict[int, int] = {}  # engine -> GPUs (TP ranks)

    @property
    def is_sender(self) -> bool:
        return self.trainer_rank in self.serves

    @property
    def exchanges(self) -> bool:
        """Whether an engine spans several trainer ranks (their payloads meet at the engine's first rank)."""
        return any(k > 1 for k in self.gpus.values())

    def _connect(self, master_address: str, master_port: int | None) -> None:
        self.gpus = self.engine_gpus()
        gpus = [self.gpus[i] for i in range(len(self.engines))]
        if sum(gpus) > self.trainer_world_size:
            raise EngineUnsupportedError(
                f"--colocate: the engines hold {sum(gpus)} GPUs ({gpus}) but the trainer has "
                f"{self.trainer_world_size} ranks; an engine's TP ranks share the trainer ranks' GPUs"
            )
        self.serves = colocated_layout(gpus)
        if self.exchanges and self.trainer_world_size > 1 and self._all_gather is None:
            raise ValueError(
                "colocated engines of several GPUs need the trainer ranks' all_gather; "
                "pass connect(..., all_gather=<trainer all_gather>)"
            )

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender and not self.exchanges:
            for _ in named:
                pass
            return {}
        pack_s = 0.0

        def start(bucket: list[NamedTensor]) -> Callable[[], None]:
            nonlocal pack_s
            t0 = time.perf_counter()
            packed = pack(bucket) if self.is_sender else None
            pack_s += time.perf_counter() - t0
            try:
                fut = self._post_bucket(packed, version)
            except BaseException:
                if packed is not None:
                    packed.release()
                raise

            def finish() -> None:
                try:
                    self._finish_bucket(fut)
                finally:
                    if packed is not None:
                        packed.release()

            return finish

        buckets = self._send_buckets(named, start)
        # pack_seconds: the trainer's share (copies into the flat buffers, waited for, and the IPC handles)
        return {"weight_sync/buckets": float(buckets), "weight_sync/pack_seconds": pack_s}

    def _post_bucket(self, packed: PackedBucket | None, version: int) -> Any:
        """Post this rank's bucket (with its engine's other TP ranks' payloads) if it leads its engine."""
        payloads = {self.trainer_rank: packed.payload if packed else None}
        if self.exchanges and self._all_gather is not None:
            payloads = dict(enumerate(self._all_gather(payloads[self.trainer_rank])))
        if not self.is_sender:
            return None
        engine, tp_rank = self.serves[self.trainer_rank]
        if tp_rank != 0:
            return None
        entries = [payloads[self.trainer_rank + r] for r in range(self.gpus[engine])]
        return self._start_engines(
            "update_weights_from_tensor",
            lambda i: {
                "serialized_named_tensors": entries,
                "weight_version": str(version),
                "flush_cache": False,
            },
            [engine],
        )

    def _finish_bucket(self, fut: Any) -> None:
        """Wait for the engine's answer; with engines of several GPUs every rank learns whether it came."""
        error: Exception | None = None
        if fut is not None:
            try:
                self._wait_engines(fut, "update_weights_from_tensor")
            except Exception as exc:  # noqa: BLE001 - shared with the other ranks first, then raised
                error = exc
        if self.exchanges and self._all_gather is not None:
            failed = [e for e in self._all_gather(None if error is None else str(error)) if e is not None]
            if failed and error is None:
                raise EngineCallError(
                    f"update_weights_from_tensor failed on another trainer rank's engine: {failed[0]}"
                )
        if error is not None:
            raise error

    def _close(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # buffers whose engine answered late (after a timeout) are freed here
