"""Process groups made only for weight sync, outside any default torch.distributed world.

A trainer already runs inside its own default world (FSDP), and an engine may run inside its
own (tensor parallelism). `init_process_group` can be called once per process, so the weight
path builds its groups by hand: a TCPStore rendezvous on the sync source's address, a
PrefixStore per group name (several groups can share one process), and a ProcessGroupGloo or
ProcessGroupNCCL object used directly. Every step carries a timeout, so a missing or dead peer
becomes an error naming the group, the rank and the address instead of a hang.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

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
    store: object
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def wait(self, work: object, what: str) -> None:
        """Wait for one async collective, turning a timeout or peer failure into a named error."""
        try:
            if self.backend == "gloo":
                ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                # NCCL's watchdog enforces the group timeout; wait() only syncs the stream.
                ok = work.wait()
        except RuntimeError as exc:
            raise WeightSyncTimeoutError(
                f"weight-sync group {self.name!r} (rank {self.rank}/{self.world_size}, {self.backend}): {what} failed "
                f"or timed out after {self.timeout_s}s: {exc}; a peer died or is too slow "
                "(raise weight_sync_timeout_s if the transfer is legitimately slow)"
            ) from exc
        if ok is False:
            raise WeightSyncTimeoutError(f"weight-sync group {self.name!r}: {what} did not complete")

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> list[object]:
        """Issue one async broadcast per tensor (all in flight at once); returns the work handles."""
        works = []
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            works.append(self.pg.broadcast([t], opts))
        return works

    def send(self, tensors: list[torch.Tensor], dst: int) -> list[object]:
        return [self.pg.send([t], dst, i) for i, t in enumerate(tensors)]

    def recv(self, tensors: list[torch.Tensor], src: int) -> list[object]:
        return [self.pg.recv([t], src, i) for i, t in enumerate(tensors)]

    def barrier(self) -> None:
        if self.backend == "nccl":
            t = torch.zeros(1, device=self.device)
            self.wait(self.pg.allreduce([t]), "barrier")
        else:
            self.wait(self.pg.barrier(), "barrier")

    def destroy(self) -> None:
        """Release the group; safe to call twice."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                if hasattr(pg, "shutdown"):
                    pg.shutdown()
            except RuntimeError as exc:  # a group whose peers already left cannot shut down cleanly
                logger.debug("shutdown of group %s: %s", self.name, exc)
        self.store = None


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
    `timeout_s` (an engine that never got /init_weights_update_group, a wrong address or port).
    """
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend={backend!r} is not supported; use one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the weight-sync world of size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"group {group_name!r} at {master_address}:{master_port} (rank {rank}/{world_size}, {backend})"
    try:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=True
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WeightSyncTimeoutError(
            f"weight-sync rendezvous of {where} failed within {timeout_s}s: {exc}; check that every engine was asked "
            "to join (init_weights_update_group) and that the address is reachable"
        ) from exc
    prefixed = PrefixStore(f"miles_weights/{group_name}", store)
    device = torch.device("cpu")
    try:
        if backend == "gloo":
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=_gloo_host(master_address))]
            pg = ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = ProcessGroupNCCL(prefixed, rank, world_size, opts)
            device = torch.device("cuda", torch.cuda.current_device())
    except RuntimeError as exc:
        raise WeightSyncTimeoutError(f"creating the process group of {where} failed: {exc}") from exc
    group = SyncGroup(group_name, backend, rank, world_size, timeout_s, pg, store, device)
    # Gloo connects lazily per pair; a barrier makes a wrong world size fail here, not mid-update.
    group.barrier()
    logger.info("joined weight-sync %s", where)
    return group


def _gloo_host(master_address: str) -> str:
    # Gloo binds the address it advertises; loopback masters keep everything on loopback.
    if master_address in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostname()


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16 (SGLang sends the short names)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected e.g. 'bfloat16', 'float32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
