"""The trainer side of every weight transport: the engine endpoints it drives, its errors, shared machinery.

A transport subclasses `WeightUpdater` and fills in `_connect`, `_transfer` (and `_close`); the
registry (`miles.weights.registry`) maps `--update-weight-transfer-mode` to one. Every trainer rank
builds the same updater and calls it collectively:

    updater = make_updater(weights_cfg, colocate=engine_cfg.colocate)
    updater.connect(engines, trainer_rank=rank, trainer_world_size=world)
    metrics = updater.update(backend.named_hf_tensors(dtype), version)   # every rank, every push
    updater.close()

`engines` are `EngineControl` objects (the async weight endpoints of `EngineClient`). The updater
runs their coroutines on a private event-loop thread, so `update` is a plain blocking call that
overlaps engine requests with the collectives issued from the calling thread. Pausing and
resuming generation belongs to the caller; the updater moves the weights and bumps each engine's
weight version. Every wait carries `weight_sync_timeout_s`; a failing engine is named in the error.
A transport may hold engines back on their old version instead of failing (disk-delta, when a
host refuses a version): those engines keep serving it, their version is not bumped, and the
metrics say so (`weight_sync/refused_engines`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol

from miles.config_sections import WeightsConfig
from miles.weights import verify
from miles.weights.bucket import NamedTensor, iter_buckets, pipelined, tensor_nbytes

logger = logging.getLogger(__name__)


class EngineControl(Protocol):
    """The engine endpoints the weight path uses (EngineClient implements them over HTTP)."""

    async def init_weights_update_group(self, **kw: Any) -> None: ...
    async def destroy_weights_update_group(self, group_name: str = "miles") -> None: ...
    async def update_weights_from_distributed(self, **kw: Any) -> None: ...
    async def update_weights_from_tensor(self, **kw: Any) -> None: ...
    async def update_weights_from_disk(self, **kw: Any) -> None: ...
    async def pull_weights(self, **kw: Any) -> dict: ...
    async def update_weight_version(self, new_version: str | int) -> None: ...
    async def weights_checker(self, **kw: Any) -> dict: ...

    # Miles-only (direct colocated updates); EngineClient reaches them through request("POST", "/miles/...").
    # async def export_weight_buffer(self) -> dict | None
    # async def install_weight_buffer(self, generation: int, weight_version: str) -> None


class EngineCallError(RuntimeError):
    """One or more engines failed (or did not answer in time) during a weight update."""


class _LoopThread:
    """A private asyncio loop on a daemon thread, owned by one updater and stopped by close()."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="miles-weight-sync", daemon=True)
        self.thread.start()

    def submit(self, coro: Awaitable[Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class WeightUpdater:
    """Shared machinery: engine calls with timeouts and names, version bump, the equality check."""

    mode: ClassVar[str] = ""

    def __init__(self, cfg: WeightsConfig | None = None) -> None:
        cfg = cfg or WeightsConfig()
        self.cfg = cfg
        self.bucket_bytes = int(cfg.update_weight_buffer_size)
        self.timeout_s = float(cfg.weight_sync_timeout_s)
        self.check_equal = bool(cfg.check_weight_update_equal)
        self.digest = verify.check_digest_name(cfg.update_weight_digest)
        self.engines: list[EngineControl] = []
        self.trainer_rank = 0
        self.trainer_world_size = 1
        self.weight_version: int | None = None
        self._barrier: Callable[[], None] | None = None
        self._checked = False
        self._loop: _LoopThread | None = None
        self.engine_failures: list[str] = []  # filled as engine calls fail, read when a collective fails
        self.held_back: set[int] = set()  # engines that kept their old weights in this update (set by _transfer)
        # set by _transfer when the transport's own install call already gave every engine the version
        self.version_installed = False

    # -- public API --------------------------------------------------------------------------

    def connect(
        self,
        engines: Sequence[EngineControl],
        *,
        trainer_rank: int = 0,
        trainer_world_size: int = 1,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        """Attach to the engines. `barrier` synchronises the trainer ranks (needed by p2p with several ranks)."""
        if not engines:
            raise ValueError("connect() got no engines")
        self.engines = list(engines)
        self.trainer_rank, self.trainer_world_size = trainer_rank, trainer_world_size
        self._barrier = barrier
        if self._loop is None:
            self._loop = _LoopThread()
        if self.is_leader:
            self._prepare_engines()
        if self.check_equal and self.is_leader and not self._checked:
            self._noise_before_connect()
        self._connect(master_address, master_port)
        # Senders other than the leader must not deliver before the leader's noise fill.
        self._sync_trainers()

    def update(self, named_tensors: Iterable[NamedTensor], version: int) -> dict[str, float]:
        """Push one version; every trainer rank calls this with its stream. Returns metrics (leader's are complete)."""
        if not self.engines:
            raise RuntimeError("update() before connect(); call connect(engines, ...) first")
        start = time.perf_counter()
        self.engine_failures.clear()
        self.held_back = set()
        self.version_installed = False
        digests: dict[str, str] = {}
        checking = self.check_equal and not self._checked
        stream: Iterable[NamedTensor] = iter(named_tensors)
        if checking and self.is_sender:
            stream = verify.digesting(stream, digests, self.digest)
        counted = _Counter(stream)
        metrics = self._transfer(counted, version)
        self._sync_trainers()
        checking = checking and not self.held_back  # the check waits for an update every engine took
        if self.is_leader:
            took = [i for i in range(len(self.engines)) if i not in self.held_back]
            if took and not self.version_installed:
                self._run_engines("update_weight_version", lambda i: {"new_version": str(version)}, took)
            if checking:
                self._run(verify.check_engines(self.engines, digests, self.digest))
        # No rank may start the next version while the leader still bumps versions or checks.
        self._sync_trainers()
        self._checked = self._checked or checking
        self.weight_version = version
        elapsed = time.perf_counter() - start
        metrics.update(
            {
                "weight_sync/seconds": elapsed,
                "weight_sync/bytes": float(counted.nbytes),
                "weight_sync/gb_per_s": counted.nbytes / 1e9 / max(elapsed, 1e-9),
                "weight_sync/version": float(version),
            }
        )
        return metrics

    def close(self) -> None:
        try:
            if self._loop is not None and self.engines:
                self._close()
        finally:
            if self._loop is not None:
                self._loop.stop()
                self._loop = None

    # -- subclass hooks ------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Trainer rank 0 drives engine-wide calls (group setup, version bump, checks)."""
        return self.trainer_rank == 0

    @property
    def is_sender(self) -> bool:
        return self.is_leader

    def _prepare_engines(self) -> None:
        """Leader-only work on the engines' startup weights, before the equality check's noise."""

    def _connect(self, master_address: str, master_port: int | None) -> None:
        raise NotImplementedError

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    # -- helpers -------------------------------------------------------------------------------

    def _noise_before_connect(self) -> None:
        # Before any transport can deliver, so a tensor it forgets keeps this noise.
        self._run(verify.fill_engines_with_noise(self.engines))

    def _sync_trainers(self) -> None:
        if self.trainer_world_size > 1 and self._barrier is not None:
            self._barrier()

    def _run(self, coro: Awaitable[Any], timeout_s: float | None = None) -> Any:
        assert self._loop is not None
        return self._loop.submit(coro).result(timeout=(timeout_s or self.timeout_s) + 5)

    def _start_engines(
        self, method: str, kwargs_of: Callable[[int], dict | None], indices: Iterable[int] | None = None
    ) -> Future:
        """Call `method` on the chosen engines concurrently; the future resolves to their results (by index)."""
        assert self._loop is not None
        chosen = list(range(len(self.engines)) if indices is None else indices)
        return self._loop.submit(self._call_engines(method, kwargs_of, chosen))

    def _run_engines(
        self, method: str, kwargs_of: Callable[[int], dict | None], indices: Iterable[int] | None = None
    ) -> dict:
        return self._wait_engines(self._start_engines(method, kwargs_of, indices), method)

    def _wait_engines(self, fut: Future, method: str) -> dict:
        try:
            return fut.result(timeout=self.timeout_s + 10)
        except TimeoutError as exc:
            fut.cancel()
            raise EngineCallError(f"{method}: engines did not answer within {self.timeout_s}s") from exc

    async def _call_engines(self, method: str, kwargs_of: Callable[[int], dict | None], chosen: list[int]) -> dict:
        async def one(i: int) -> Any:
            engine = self.engines[i]
            try:
                return await asyncio.wait_for(getattr(engine, method)(**(kwargs_of(i) or {})), self.timeout_s)
            except asyncio.TimeoutError as exc:
                err = EngineCallError(f"engine {i} ({engine!r}) did not finish {method} within {self.timeout_s}s")
                self.engine_failures.append(str(err))
                raise err from exc
            except Exception as exc:
                err = EngineCallError(f"engine {i} ({engine!r}) failed {method}: {type(exc).__name__}: {exc}")
                self.engine_failures.append(str(err))
                raise err from exc

        results = await asyncio.gather(*(one(i) for i in chosen), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise EngineCallError("; ".join(str(e) for e in errors)) from errors[0]
        return dict(zip(chosen, results, strict=True))

    def engine_failure_detail(self, fut: Future, method: str, wait_s: float = 5.0) -> str:
        """After a collective failed: the engines that already reported failing, waiting briefly for them."""
        deadline = time.monotonic() + min(wait_s, self.timeout_s)
        while not self.engine_failures and not fut.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine_failures:
            return "; engine side: " + "; ".join(self.engine_failures)
        return f"; no engine has reported failing {method} yet"

    def _send_buckets(
        self, named: Iterable[NamedTensor], start: Callable[[list[NamedTensor]], Callable[[], None]]
    ) -> int:
        return pipelined(iter_buckets(named, self.bucket_bytes), start)


class _Counter:
    """Counts tensors and bytes of the stream as a transport consumes it."""

    def __init__(self, named: Iterable[NamedTensor]) -> None:
        self._it = iter(named)
        self.tensors = 0
        self.nbytes = 0

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> NamedTensor:
        name, t = next(self._it)
        self.tensors += 1
        self.nbytes += tensor_nbytes(t)
        return name, t
