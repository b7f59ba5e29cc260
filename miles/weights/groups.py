"""Process groups made only for weight sync, outside any default torch.distributed world.

A trainer already runs inside its own default world (FSDP), and an engine may run inside its
own (tensor parallelism), so the weight path builds its groups the way SGLang's
`init_custom_process_group` does, which is what a vanilla SGLang server runs on
`/init_weights_update_group`: a `tcp://` rendezvous on the sync source's address (rank 0 hosts
the TCPStore), the store prefixed with the group's name, and torch's own process-group helper.
Both ends therefore meet under the same store keys, whether the other end is SGLang, the
embedded engine or another trainer rank. Collectives are `torch.distributed.broadcast(..., group=pg)`
as in SGLang.
Neither end issues any collective the other does not: no barrier after the rendezvous (SGLang
issues none); a wrong world size times out in the rendezvous instead.
Every step carries a timeout, so a missing or dead peer becomes an error naming the group, the
rank and the address instead of a hang.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _unregister_process_group
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WeightSyncTimeoutError(TimeoutError):
    """A rendezvous or collective of the weight path ran past its timeout."""


@dataclass(slots=True)
class SyncGroup:
    """One weight-sync process group plus what is needed to run collectives on it with a timeout."""

    name: str
    backend: str
    rank: int
    world_size: int
    timeout_s: float
    pg: object
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    failed: bool = False  # a collective failed: peers may still wait in theirs until this end closes

    def wait(self, work: object, what: str) -> None:
        """Wait for one async collective, turning a timeout or peer failure into a named error."""
        try:
            if self.backend == "gloo":
                ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                # NCCL's watchdog enforces the group timeout; wait() only syncs the stream.
                ok = work.wait()
        except RuntimeError as exc:
            self.failed = True
            raise WeightSyncTimeoutError(
                f"weight-sync group {self.name!r} (rank {self.rank}/{self.world_size}, {self.backend}): {what} failed "
                f"or timed out after {self.timeout_s}s: {exc}; a peer died or is too slow "
                "(raise weight_sync_timeout_s if the transfer is legitimately slow)"
            ) from exc
        if ok is False:
            self.failed = True
            raise WeightSyncTimeoutError(f"weight-sync group {self.name!r}: {what} did not complete")

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> list[object]:
        """Issue one async broadcast per tensor from group rank `src` (all in flight at once); returns the works.

        The same call SGLang's receiving side makes (`torch.distributed.broadcast(t, src=0, group=pg,
        async_op=True)` per tensor), so the two ends pair their collectives one to one."""
        if self.pg is None:
            raise RuntimeError(f"weight-sync group {self.name!r} was destroyed")
        return [dist.broadcast(t, src=src, group=self.pg, async_op=True) for t in tensors]

    def destroy(self) -> None:
        """Release the group (its name can be joined again afterwards); safe to call twice."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                c10d._world.pg_names[pg] = self.name  # noqa: SLF001 - what destroy_process_group looks up
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError) as exc:  # a group whose peers already left cannot shut down cleanly
                logger.debug("destroying group %s: %s", self.name, exc)


def create_sync_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> SyncGroup:
    """Join the weight-sync group `group_name`; rank 0 hosts the TCPStore. Blocks until every rank joined.

    Raises WeightSyncTimeoutError naming the group when the other ranks do not arrive within
    `timeout_s` (an engine that never got /init_weights_update_group, a wrong address, port or
    world size).
    """
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend={backend!r} is not supported; use one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the weight-sync world of size {world_size}")
    if not group_name:
        raise ValueError("a weight-sync group needs a non-empty group_name")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"group {group_name!r} at {master_address}:{master_port} (rank {rank}/{world_size}, {backend})"
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    try:
        store, _, _ = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WeightSyncTimeoutError(
            f"weight-sync rendezvous of {where} failed within {timeout_s}s: {exc}; check that every engine was asked "
            "to join (init_weights_update_group), that the address is reachable and that world_size counts "
            "every engine GPU"
        ) from exc
    try:
        pg, _ = c10d._new_process_group_helper(  # noqa: SLF001 - what SGLang's init_custom_process_group calls
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            c10d.PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WeightSyncTimeoutError(f"creating the process group of {where} failed: {exc}") from exc
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # noqa: SLF001 - group rank == group index
    # torch lets one member per name join from a process; a trainer and an engine in one process (tests) are two
    # members, so the name is released here and given back when the group is destroyed.
    c10d._world.pg_names.pop(pg, None)  # noqa: SLF001
    _unregister_process_group(group_name)  # torch's by-name registry (functional collectives; unused here)
    logger.info("joined weight-sync %s", where)
    return SyncGroup(group_name, backend, rank, world_size, timeout_s, pg, device)


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16 (SGLang sends the short names)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected e.g. 'bfloat16', 'float32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
