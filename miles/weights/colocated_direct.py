"""Direct colocated update: the trainer writes straight into the engine's weights on the same device.

The engine keeps all its weight storage in ONE flat buffer (`WeightArena`: 256-byte aligned
entries, every storage tensor a view of it): a device allocation on GPU, a named POSIX
shared-memory segment on CPU. It exports that buffer (a CUDA IPC handle, or the segment's name)
with, for every HF name, the (byte offset, shape, stride, dtype) of the engine's view, and a
`generation` that changes whenever the buffer is reallocated (a memory release and resume).

An update (`DirectColocatedUpdater`) per engine:
1. makes sure the buffer it maps is still the engine's: the engine publishes its current
   generation in eight bytes of shared memory (`GenerationWord`), which the trainer reads; only when
   it changed (or at first) does the trainer ask for the export over HTTP, map the new buffer and
   build its per-name views once;
2. copies each (HF name, tensor) the trainer yields into the engine's view, device to device, cast to
   the engine dtype, no staging buffer: same-dtype tensors in `_foreach_copy_` batches of 64;
3. records an inter-process CUDA event behind the copies and makes one install call carrying it:
   the engine makes its stream wait for that event (the call and its answer travel while the GPU
   still copies), checks the generation is still current, bumps its KV epoch (no KV computed with
   the old weights is reused) and takes the weight version. The update returns once the answer is
   in and the trainer's stream has finished the copies; only then does the controller let
   generation go on.
The controller pauses the engines around an update; the engine refuses an export or install while
it is generating.

Mapping lifetime: the trainer asks for the buffer `for_mapping`, and on CUDA the engine shares it anew for
each such export: torch counts each share once, and the trainer's mapping gives that count back when it
closes. At the engine's release a buffer no mapping counts is freed at once; one a mapping still counts waits
in torch's IPC limbo until that mapping closes (arena.py). With `keep_mapping`
(the default) the trainer keeps its mapping and views between updates and never writes into them
unless step 1 found the generation still current (the engine publishes 0 before it frees a buffer;
the controller never releases engine memory during an update); a run whose engines
release their weights between updates (`--offload-rollout-level` with `weight`) makes the updater
close its mapping at the end of every update instead, so nothing of the trainer pins the buffer
the engine is about to free.

Engines without the export (real SGLang: no /miles/export_weight_buffer) keep the per-bucket handoff
of colocated.py; the updater falls back to it on the first update.

Where each part lives: the engine's buffer in miles/weights/arena.py, the trainer's mapping and
copies in miles/weights/buffer_writer.py, the updater that drives an update here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from miles.weights.base import EngineCallError
from miles.weights.buffer_writer import MappedBuffer
from miles.weights.colocated import ColocatedUpdater
from miles.weights.tensor_ipc import b64

logger = logging.getLogger(__name__)

EXPORT_ENDPOINT = "/miles/export_weight_buffer"  # miles-only, like its install endpoint: SGLang has neither


async def _post_miles(engine: Any, method: str, payload: dict) -> dict | None:
    """Call a miles-only weight endpoint; None when the engine does not have it (HTTP 404)."""
    fn = getattr(type(engine), method, None)
    if fn is not None:  # fake engines and clients that name the endpoint
        return await getattr(engine, method)(**payload)
    status, body = await engine.request("POST", f"/miles/{method}", payload, ok_statuses=(404,))
    return None if status == 404 else body


class DirectColocatedUpdater(ColocatedUpdater):
    """Writes into the weight buffer of the engine on the same device; trainer rank i serves engine i.

    Falls back to the per-bucket handoff (`ColocatedUpdater`) for an engine without the export.
    `keep_mapping=False` closes the mapping at the end of every update (engines that release their
    weights between updates); otherwise it is kept while the engine's buffer generation is unchanged.
    """

    mode = "colocated"

    def __init__(self, cfg=None, *, keep_mapping: bool = True) -> None:
        super().__init__(cfg)
        self.direct: bool | None = None  # None until the first update asked the engine
        self.keep_mapping = keep_mapping
        self._mapped: MappedBuffer | None = None
        self._ready: torch.cuda.Event | None = None  # recorded behind the copies, waited for by the engine
        self._ready_handle: str | None = None

    def _transfer(self, named, version: int) -> dict[str, float]:
        if not self.is_sender or self.direct is False or self.exchanges:  # engines of several GPUs: SGLang's path
            return super()._transfer(named, version)
        t0 = time.perf_counter()
        if self._mapped is not None and self._mapped.still_current():
            export = {"generation": self._mapped.generation, "unchanged": True}
        else:
            known = {} if self._mapped is None else {"generation": self._mapped.generation}
            export = self._call_engine("export_weight_buffer", {**known, "for_mapping": True})
        if export is None:
            logger.info(
                "engine %d has no %s; using the per-bucket colocated handoff", self.trainer_rank, EXPORT_ENDPOINT
            )
            self.direct = False
            return super()._transfer(named, version)
        self.direct = True
        t_map = time.perf_counter()
        try:
            if not export.get("unchanged"):
                self._drop_mapping()
                self._mapped = MappedBuffer(export)
            mapped = self._mapped
            assert mapped is not None and mapped.writer is not None
            t_copy = time.perf_counter()
            tensors, _ = mapped.writer.write(named)
            payload = {"generation": mapped.generation, "weight_version": str(version)}
            stream = torch.cuda.current_stream(mapped.flat.device) if mapped.flat.is_cuda else None
            if stream is not None:
                payload["ready_event"] = self._record_ready(stream)
            t_install = time.perf_counter()
            self._call_engine("install_weight_buffer", payload)
            if stream is not None:
                stream.synchronize()  # the copies are done: the engine may serve, the trainer reuse its tensors
            t_done = time.perf_counter()
        except BaseException:
            self._drop_mapping()  # a stale or failed write: map afresh next time
            raise
        if not self.keep_mapping:
            self._drop_mapping()
        self.version_installed = True
        return {
            "weight_sync/buckets": 0.0,
            "weight_sync/direct_tensors": float(tensors),
            "weight_sync/direct_export_seconds": t_map - t0,  # generation check, or the export call
            "weight_sync/direct_map_seconds": t_copy - t_map,  # opening a new buffer (0 when kept)
            "weight_sync/direct_issue_seconds": t_install - t_copy,  # the host issuing the copies
            "weight_sync/direct_seconds": t_done - t_copy,  # first copy issued -> install answered
            "weight_sync/direct_unmap_seconds": time.perf_counter() - t_done,
        }

    def _call_engine(self, method: str, payload: dict) -> dict | None:
        """One miles-only call to this rank's engine; a failure or timeout names the engine."""
        engine = self.engines[self.trainer_rank]
        try:
            return self._run(asyncio.wait_for(_post_miles(engine, method, payload), self.timeout_s))
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise EngineCallError(
                f"engine {self.trainer_rank} ({engine!r}) did not finish {method} within {self.timeout_s}s"
            ) from exc
        except Exception as exc:
            raise EngineCallError(
                f"engine {self.trainer_rank} ({engine!r}) failed {method}: {type(exc).__name__}: {exc}"
            ) from exc

    def _record_ready(self, stream: torch.cuda.Stream) -> str:
        if self._ready is None:
            self._ready = torch.cuda.Event(interprocess=True)
            self._ready.record(stream)
            self._ready_handle = b64(self._ready.ipc_handle())
        else:
            self._ready.record(stream)
        assert self._ready_handle is not None
        return self._ready_handle

    def _drop_mapping(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None

    def close(self) -> None:
        self._drop_mapping()
        super().close()
