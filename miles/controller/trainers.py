"""The trainer ranks of a run behind typed calls.

Each method is one `miles.workers.trainer_worker.TrainerWorker` method called on every rank at once
(the ranks run collectives together, so none may be left out); results come back in rank order
and the methods return what the controller reads: rank 0's metrics, rank 0's resume state. A test
holds the method names equal to TrainerWorker's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.controller.runtime import Runtime
from miles.rollout.train_data import TrainBatch
from miles.wire.rpc import RemoteError

ROLE = "trainer"


class TrainerGroup:
    """Calls every trainer rank; timeouts are the runtime's default (`--rpc-timeout-s`) unless a method says.

    A run without trainer (`--debug-rollout-only`) has an empty group: every call does nothing and
    returns nothing (no metrics, no resume state)."""

    def __init__(self, runtime: Runtime, *, empty: bool = False) -> None:
        self._runtime = runtime
        self._empty = empty  # the run planned no trainer rank

    @property
    def size(self) -> int:
        return 0 if self._empty else len(self._runtime.workers(ROLE))

    def __bool__(self) -> bool:
        return not self._empty

    async def _all(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        if self._empty:
            return []
        return await self._runtime.call_all(ROLE, method, *args, timeout_s=timeout_s, **kwargs)

    async def setup(self) -> None:
        """Join the training world and build the backend."""
        await self._all("setup")

    async def memory_plan(self) -> list[dict[str, Any] | None]:
        """Each rank's memory estimate beside its colocated engine (None: the backend cannot tell), for offload."""
        return await self._all("memory_plan")

    async def connect_engines(self, urls: list[str], *, colocated: bool, keep_weight_mapping: bool) -> None:
        """Build the weight updater for the --update-weight-transfer-mode each rank's config holds (sent once,
        with its settings) and attach it to the engines at `urls`."""
        await self._all("connect_engines", urls, colocated=colocated, keep_weight_mapping=keep_weight_mapping)

    async def push_weights(self, version: int, *, timeout_s: float) -> dict[str, float]:
        """Move the weights to the engines as `version`; rank 0's metrics (the complete ones)."""
        return next(iter(await self._all("push_weights", version, timeout_s=timeout_s)), {})

    async def close_weights(self, *, timeout_s: float = 30.0) -> None:
        await self._all("close_weights", timeout_s=timeout_s)

    async def train(self, rollout_id: int, shards: list[TrainBatch]) -> dict[str, float]:
        """One RL step, shard i on rank i; rank 0's metrics (already reduced over the ranks)."""
        workers = [] if self._empty else self._runtime.workers(ROLE)
        calls = [w.call("train", shard.to_dict(), rollout_id) for w, shard in zip(workers, shards, strict=True)]
        return next(iter(await asyncio.gather(*calls)), {})

    async def save(self, path: str, extra_state: dict[str, Any]) -> None:
        """A checkpoint at `path`; a failed write (a full disk, say) is raised as its one-line reason.
        With --async-save the ranks return once their state is staged; `finish_saves` waits for the write."""
        await self._checkpoint_call("save", path, extra_state)

    async def finish_saves(self) -> None:
        """The checkpoint still being written in the background is complete (its failure is raised here)."""
        await self._checkpoint_call("finish_saves")

    async def _checkpoint_call(self, method: str, *args: Any) -> None:
        try:
            await self._all(method, *args)
        except RemoteError as e:
            if e.exc_type != "CheckpointWriteError":
                raise
            from miles.trainer.checkpoint_layout import CheckpointWriteError

            raise CheckpointWriteError(e.remote_message) from None

    async def load(self, path: str) -> dict[str, Any]:
        """Resume from the checkpoint at `path`; rank 0's extra state (rollout id, data source, ...)."""
        return next(iter(await self._all("load", path)), {})

    async def export_hf(self, path: str) -> None:
        """The current weights as a Hugging Face directory at `path`."""
        await self._all("export_hf", path)

    async def offload(self) -> None:
        await self._all("offload")

    async def onload(self) -> None:
        await self._all("onload")

    async def release_cached_memory(self) -> list[dict[str, float]]:
        """Each rank's cached, unused device memory back to the driver (before colocated engines resume)."""
        return await self._all("release_cached_memory")
