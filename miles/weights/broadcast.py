"""Broadcast transport (default): trainer rank 0 broadcasts each bucket to every engine rank.

The sync group is made for weight sync only, as vanilla SGLang's `/init_weights_update_group`
joins it: the trainer source is rank 0 and an engine of k GPUs (SGLang's tp_size, read from its
`/server_info`) holds k ranks, `rank_offset + tp_rank`, so engine i gets
`rank_offset = 1 + sum of the GPUs of engines 0..i-1` and the world is 1 + every engine GPU.
For each bucket the source posts `update_weights_from_distributed(names, dtypes, shapes, ...)`
to every engine and, at the same time, issues one async broadcast per tensor; every engine rank
receives each tensor whole. Other trainer ranks only take part in producing the stream (FSDP
gathers) and send nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from miles.weights.base import EngineCallError, WeightUpdater, group_layout
from miles.weights.bucket import NamedTensor, bucket_meta
from miles.weights.groups import SyncGroup, WeightSyncTimeoutError, create_sync_group
from miles.wire.ports import free_port

logger = logging.getLogger(__name__)


class GroupUpdater(WeightUpdater):
    """A transport that holds a process group made only for weight sync with the engines."""

    default_group_name = "miles"

    def __init__(self, *args, group_name: str | None = None, backend: str | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.group_name = group_name or self.default_group_name
        self.backend = backend  # None: nccl when CUDA is available, else gloo
        self.group: SyncGroup | None = None

    def _backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")

    def _close(self) -> None:
        if self.group is None:
            return
        if self.group.failed:
            # engines still inside the broken collective answer destroy only when it ends: closing this end
            # ends it at once ("connection closed by peer") instead of at their time-out
            self.group.destroy()
        if self.is_leader:
            try:
                self._run_engines("destroy_weights_update_group", lambda i: {"group_name": self.group_name})
            except EngineCallError as exc:
                logger.warning("destroying weight-sync group %r on the engines: %s", self.group_name, exc)
        self.group.destroy()
        self.group = None


class BroadcastUpdater(GroupUpdater):
    mode = "broadcast"

    def _connect(self, master_address: str, master_port: int | None) -> None:
        if not self.is_sender:
            return
        if self.group is not None:  # reconnect: engines drop the old group first
            self._close()
        port = master_port or free_port(master_address)
        backend = self._backend()
        gpus = self.engine_gpus()
        world_size, offsets = group_layout([gpus[i] for i in range(len(self.engines))])
        fut = self._start_engines(
            "init_weights_update_group",
            lambda i: {
                "master_address": master_address,
                "master_port": port,
                "rank_offset": offsets[i],
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": backend,
            },
        )
        try:
            self.group = create_sync_group(
                backend, master_address, port, world_size, 0, self.group_name, self.timeout_s
            )
        except WeightSyncTimeoutError as exc:
            raise_with_engine_errors(exc, fut, self, "init_weights_update_group")
        self._wait_engines(fut, "init_weights_update_group")
        logger.info(
            "broadcast weight sync: group %r, %d engines (%d ranks), %s at %s:%d",
            self.group_name,
            len(self.engines),
            world_size - 1,
            backend,
            master_address,
            port,
        )

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_sender:
            for _ in named:  # take part in the collective gathers that produce the stream
                pass
            return {}
        buckets = self._send_buckets(named, lambda bucket: self._start_bucket(bucket, version))
        return {"weight_sync/buckets": float(buckets)}

    def _start_bucket(self, bucket: list[NamedTensor], version: int) -> Callable[[], None]:
        assert self.group is not None
        meta = bucket_meta(bucket)
        payload = {
            "names": meta.names,
            "dtypes": meta.dtypes,
            "shapes": meta.shapes,
            "group_name": self.group_name,
            "weight_version": str(version),
            "flush_cache": False,
        }
        fut = self._start_engines("update_weights_from_distributed", lambda i: payload)
        tensors = [t if t.device == self.group.device else t.to(self.group.device) for _, t in bucket]
        works = self.group.broadcast(tensors, src=0)

        def finish() -> None:
            try:
                for name, work in zip(meta.names, works, strict=True):
                    self.group.wait(work, f"broadcast of {name!r}")
            except WeightSyncTimeoutError as exc:
                raise_with_engine_errors(exc, fut, self, "update_weights_from_distributed")
            self._wait_engines(fut, "update_weights_from_distributed")
            del tensors[:]

        return finish


def raise_with_engine_errors(exc: Exception, fut, updater: WeightUpdater, method: str) -> None:
    """A collective failed: name the engines that failed their side of it."""
    raise WeightSyncTimeoutError(f"{exc}{updater.engine_failure_detail(fut, method)}") from exc
