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

from miles.config import WeightsConfig
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
    async def server_info(self) -> dict: ...

    # Miles-only (direct colocated updates); EngineClient reaches them through request("POST", "/miles/...").
    # async def export_weight_buffer(self) -> dict | None
    # async def install_weight_buffer(self, generation: int, weight_version: str) -> None


class EngineCallError(RuntimeError):
    """One or more engines failed (or did not answer in time) during a weight update."""


class EngineUnsupportedError(ValueError):
    """An engine lacks what the chosen weight path needs (an endpoint of Miles' SGLang fork, a layout)."""


def engine_gpus(info: dict, label: str) -> int:
    """How many ranks an engine joins a weight-sync group with, from its /server_info: one per GPU of its
    tensor-parallel group (SGLang joins rank `rank_offset + tp_rank` for each TP rank). SGLang's weight
    groups hold no data- or pipeline-parallel ranks, so an engine with dp_size or pp_size > 1 is refused."""
    tp = int(info.get("tp_size") or 1)
    for key in ("dp_size", "pp_size"):
        if int(info.get(key) or 1) > 1:
            raise EngineUnsupportedError(
                f"engine {label} runs with {key}={info[key]}; SGLang's weight updates (init_weights_update_group) "
                f"support tensor parallelism only; start it with {key} 1 and --rollout-num-gpus-per-engine {tp}"
            )
    if tp < 1:
        raise EngineUnsupportedError(f"engine {label} reports tp_size={tp} in /server_info")
    return tp


def group_layout(engine_gpus: Sequence[int], first_rank: int = 1) -> tuple[int, list[int]]:
    """(world_size, rank_offset per engine) of a weight-sync group whose ranks below `first_rank` are
    trainer sources and whose engine i holds ranks rank_offset_i .. rank_offset_i + engine_gpus[i] - 1."""
    offsets, rank = [], first_rank
    for gpus in engine_gpus:
        offsets.append(rank)
        rank += gpus
    return rank, offsets


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
        self.allow_quant_error = bool(cfg.check_weight_update_allow_quant_error)
        self.digest = verify.check_digest_name(cfg.update_weight_digest)
        self.engines: list[EngineControl] = []
        self.trainer_rank = 0
        self.trainer_world_size = 1
        self.weight_version: int | None = None
        self._barrier: Callable[[], None] | None = None
        self._all_gather: Callable[[Any], list[Any]] | None = None
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
        all_gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        """Attach to the engines. `barrier` synchronises the trainer ranks (needed by p2p with several ranks);
        `all_gather(obj)` returns every trainer rank's `obj` by rank (colocated engines of several GPUs)."""
        if not engines:
            raise ValueError("connect() got no engines")
        self.engines = list(engines)
        self.trainer_rank, self.trainer_world_size = trainer_rank, trainer_world_size
        self._barrier = barrier
        self._all_gather = all_gather
        if self._loop is None:
            self._loop = _LoopThread()
        if self.is_leader:
            self._probe_engines()
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
        sketches: dict[str, list[float]] | None = {} if self.allow_quant_error else None
        checking = self.check_equal and not self._checked
        stream: Iterable[NamedTensor] = iter(named_tensors)
        if checking and self.is_sender:
            if sketches is not None:
                stream = verify.sketching(stream, sketches)
            else:
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
                self._run(verify.check_engines(self.engines, digests, self.digest, sketches=sketches))
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

    def _probe_engines(self) -> None:
        """Leader-only, before anything changes on the engines: refuse engines that lack what this path needs."""
        if self.check_equal:
            self._require_checker()

    def _prepare_engines(self) -> None:
        """Leader-only work on the engines' startup weights, before the equality check's noise."""

    def _connect(self, master_address: str, master_port: int | None) -> None:
        raise NotImplementedError

    def _transfer(self, named: Iterable[NamedTensor], version: int) -> dict[str, float]:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    # -- helpers -------------------------------------------------------------------------------

    def engine_gpus(self, indices: Iterable[int] | None = None) -> dict[int, int]:
        """Weight-group ranks per engine (by index), read from each engine's /server_info."""
        chosen = list(range(len(self.engines)) if indices is None else indices)
        asked = [i for i in chosen if hasattr(self.engines[i], "server_info")]  # in-process receivers: one rank
        infos = self._run_engines("server_info", lambda i: None, asked) if asked else {}
        return {i: engine_gpus(infos.get(i) or {}, repr(self.engines[i])) for i in chosen}

    def _require_endpoint(self, path: str, why: str) -> None:
        """Refuse, naming them, the engines that answer 404 on `path` (probed with an empty POST, which an
        engine that has the endpoint refuses as incomplete without acting on it)."""

        async def probe() -> list[bool]:
            return list(await asyncio.gather(*(endpoint_exists(e, path) for e in self.engines)))

        found = self._run(probe())
        lacking = [repr(e) for e, ok in zip(self.engines, found, strict=True) if not ok]
        if lacking:
            raise EngineUnsupportedError(f"engines {lacking} do not serve {path} (HTTP 404): {why}")

    def _require_checker(self) -> None:
        """--check-weight-update-equal needs the digest checker (fill_noise + compare by digest) on every engine."""
        infos = self._run_engines("server_info", lambda i: None)
        lacking = [
            i for i, info in infos.items() if "fill_noise" not in ((info or {}).get("weights_checker_actions") or [])
        ]
        if lacking:
            raise EngineUnsupportedError(
                f"--check-weight-update-equal: engines {[repr(self.engines[i]) for i in lacking]} have no digest "
                "weight checker (/weights_checker with fill_noise and compare by digest is served by the embedded "
                "engine only; SGLang's checker compares against its own snapshot); drop --check-weight-update-equal "
                "or use --engine embedded"
            )

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


async def endpoint_exists(engine: Any, path: str) -> bool:
    """Whether the engine serves POST `path`: anything but HTTP 404 to an empty body counts as served (an
    engine object without HTTP, such as an in-process receiver, serves it when it has the method)."""
    if not hasattr(engine, "request"):
        return callable(getattr(engine, path.strip("/").replace("/", "_"), None))
    status, _ = await engine.request("POST", path, {}, ok_statuses=(400, 404, 405, 422), max_retries=0)
    return status != 404


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
