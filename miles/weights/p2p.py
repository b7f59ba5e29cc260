"""Peer-to-peer transport: several trainer ranks send at once, each only to the engines the plan gives it.

Plan: the first min(sources, targets) ranks pair one to one; the remaining targets are spread
round-robin over the sources, so no source serves more than ceil(targets / sources) engines.
With more sources than targets the surplus sources sit idle.

Each sending source owns one weight-sync group, `<group_name>-<source>`, whose rank 0 is that
source and whose other ranks are its engines' GPUs (an engine of k GPUs holds k ranks, as in the
broadcast transport). A source posts `update_weights_from_distributed(..., group_name=its group)`
to its engines and broadcasts each tensor in its group, while every other source does the same
for its own engines. Engines see exactly vanilla SGLang's protocol: one group each, receiving
from group rank 0. Each source must see the full HF tensors (FSDP `full_tensor()` gives every
rank the whole tensor).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from miles.weights.base import EngineCallError, group_layout
from miles.weights.broadcast import GroupUpdater
from miles.weights.bucket import NamedTensor, bucket_meta
from miles.weights.groups import WeightSyncTimeoutError, create_sync_group
from miles.wire.ports import free_port

logger = logging.getLogger(__name__)


def plan_transfers(num_sources: int, num_targets: int) -> dict[int, list[int]]:
    """Map each sending source rank to the target (engine) indices it writes; idle sources are absent."""
    if num_sources < 1 or num_targets < 1:
        raise ValueError(f"p2p plan needs at least one source and one target, got {num_sources} and {num_targets}")
    paired = min(num_sources, num_targets)
    plan = {s: [s] for s in range(paired)}
    for k, target in enumerate(range(paired, num_targets)):
        plan[k % paired].append(target)
    return plan


def format_plan(plan: dict[int, list[int]], num_sources: int) -> str:
    lines = [f"p2p transfer plan ({num_sources} sources -> {sum(len(v) for v in plan.values())} targets):"]
    lines += [f"  source {s} -> engines {targets}" for s, targets in sorted(plan.items())]
    idle = [s for s in range(num_sources) if s not in plan]
    if idle:
        lines.append(f"  idle sources: {idle}")
    return "\n".join(lines)


class P2PUpdater(GroupUpdater):
    mode = "p2p"
    default_group_name = "miles-p2p"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.plan: dict[int, list[int]] = {}

    @property
    def is_sender(self) -> bool:
        return self.trainer_rank in self.plan

    @property
    def source_group(self) -> str:
        """The weight-sync group this source broadcasts in."""
        return f"{self.group_name}-{self.trainer_rank}"

    def _connect(self, master_address: str, master_port: int | None) -> None:
        self.plan = plan_transfers(self.trainer_world_size, len(self.engines))
        if self.is_leader:
            print(format_plan(self.plan, self.trainer_world_size), flush=True)
        if self.trainer_world_size > 1 and self._barrier is None:
            raise ValueError(
                "p2p with several trainer ranks needs a trainer barrier (the weight version is bumped once every "
                "source delivered); pass connect(..., barrier=<trainer barrier>)"
            )
        if not self.is_sender:
            return
        if self.group is not None:
            self._close()
        targets = self.plan[self.trainer_rank]
        gpus = self.engine_gpus(targets)
        world_size, offsets = group_layout([gpus[i] for i in targets])
        rank_offset = dict(zip(targets, offsets, strict=True))
        # Every source hosts its own group's store; the leader may use the port the ranks agreed on.
        port = master_port if master_port and self.is_leader else free_port(master_address)
        backend, name = self._backend(), self.source_group
        fut = self._start_engines(
            "init_weights_update_group",
            lambda i: {
                "master_address": master_address,
                "master_port": port,
                "rank_offset": rank_offset[i],
                "world_size": world_size,
                "group_name": name,
                "backend": backend,
            },
            targets,
        )
        try:
            self.group = create_sync_group(backend, master_address, port, world_size, 0, name, self.timeout_s)
        except WeightSyncTimeoutError as exc:
            raise WeightSyncTimeoutError(
                f"{exc}{self.engine_failure_detail(fut, 'init_weights_update_group')}"
            ) from exc
        self._wait_engines(fut, "init_weights_update_group")

    def _close(self) -> None:
        if self.group is None:
            return
        if self.group.failed:  # end the engines' side of the broken collective now, not at their time-out
            self.group.destroy()
        try:
            self._run_engines(
                "destroy_weights_update_group",
                lambda i: {"group_name": self.source_group},
                self.plan[self.trainer_rank],
            )
        except EngineCallError as exc:
            logger.warning("destroying weight-sync group %r on its engines: %s", self.source_group, exc)
        self.group.destroy()
        self.group = None

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        if not self.is_sender:
            for _ in named:
                pass
            return {}
        buckets = self._send_buckets(named, lambda bucket: self._start_bucket(bucket, version))
        return {
            "weight_sync/buckets": float(buckets),
            "weight_sync/p2p_targets": float(len(self.plan[self.trainer_rank])),
        }

    def _start_bucket(self, bucket: list[NamedTensor], version: int) -> Callable[[], None]:
        assert self.group is not None
        group = self.group
        meta = bucket_meta(bucket)
        targets = self.plan[self.trainer_rank]
        payload = {
            "names": meta.names,
            "dtypes": meta.dtypes,
            "shapes": meta.shapes,
            "group_name": self.source_group,
            "weight_version": str(version),
            "flush_cache": False,
        }
        fut = self._start_engines("update_weights_from_distributed", lambda i: payload, targets)
        tensors = [t if t.device == group.device else t.to(group.device) for _, t in bucket]
        works = group.broadcast(tensors, src=0)

        def finish() -> None:
            try:
                for name, work in zip(meta.names, works, strict=True):
                    group.wait(work, f"broadcast of {name!r} to engines {targets}")
            except WeightSyncTimeoutError as exc:
                detail = self.engine_failure_detail(fut, "update_weights_from_distributed")
                raise WeightSyncTimeoutError(f"{exc}{detail}") from exc
            self._wait_engines(fut, "update_weights_from_distributed")
            del tensors[:]

        return finish
