"""A rollout engine process: the embedded engine (or a real SGLang server) behind the SGLang HTTP protocol.

Its doors (miles/engines/doors.py): the run's API key on every endpoint, loopback unless the run spans
several nodes (then every interface, and the key is mandatory), weight endpoints limited to the run's
directories (`weight_dirs`) and the served model, request bodies up to `max_body_mb`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from miles.engines.doors import DEFAULT_MAX_BODY_MB, is_loopback
from miles.utils.gc_freeze import freeze_heap
from miles.utils.profiling import WorkerProfiler
from miles.utils.timer import seconds_since_launch
from miles.wire.ports import free_port
from miles.workers.base import Worker

logger = logging.getLogger(__name__)


def embedded_options(sglang_args: dict[str, Any]) -> dict[str, Any]:
    """The `--sglang-*` passthrough flags the embedded engine honours as well: `disable_cuda_graph`,
    `disable_radix_cache` (its prefix sharing off), `quantization` (fp8: a bf16 checkpoint served in FP8) and
    `kv_cache_dtype` (auto, fp8_e4m3 or fp8_e5m2: what its KV cache stores)."""
    options: dict[str, Any] = {}
    if sglang_args.get("disable_cuda_graph"):
        options["cuda_graphs"] = False
    if sglang_args.get("disable_radix_cache"):
        options["prefix_cache"] = False
    if sglang_args.get("quantization"):
        options["quantization"] = sglang_args["quantization"]
    if sglang_args.get("kv_cache_dtype"):
        options["kv_cache_dtype"] = sglang_args["kv_cache_dtype"]
    return options


def _import_engine_modules(kind: str) -> None:
    """Import torch and the modules that serve `kind` (the entries of `sys.modules` `on_start` then reads)."""
    import torch  # noqa: F401

    if kind == "sglang":
        import miles.engines.sglang_engine  # noqa: F401
    else:
        import miles.engines.embedded.engine
        import miles.engines.http_front
        import miles.weights.receiver  # noqa: F401


class RolloutWorker(Worker):
    def __init__(
        self,
        ctx,
        *,
        engine: str,
        model_path: str,
        device: str = "cpu",
        dtype: str = "auto",
        max_running_requests: int = 64,
        max_total_tokens: int | None = None,
        seed: int = 0,
        deterministic: bool = False,
        host: str = "127.0.0.1",
        sglang_args: dict | None = None,
        tp_size: int = 1,
        api_key: str | None = None,
        weight_dirs: list[str] | None = None,
        max_body_mb: float = DEFAULT_MAX_BODY_MB,
        true_on_policy: bool = False,
    ):
        super().__init__(ctx)
        self.kind = engine
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.seed = seed
        self.deterministic = deterministic
        # several nodes: listen on every interface so the controller and trainers elsewhere can reach us
        self.host = "0.0.0.0" if int(os.environ.get("MILES_NUM_NODES", "1")) > 1 else host
        if not is_loopback(self.host) and not api_key:
            raise ValueError(
                f"rollout engine {ctx.role}:{ctx.rank} would listen on {self.host} without an API key; "
                "every run passes one (--api-key, or a fresh key per run): start it through `miles train`"
            )
        self.api_key = api_key
        self.weight_dirs = list(weight_dirs or [])
        self.max_body_mb = max_body_mb
        self.sglang_args = sglang_args or {}
        self.tp_size = tp_size
        self.true_on_policy = true_on_policy  # prefill-only scoring through the trainer's reference forward
        self._engine = None
        self._http = None
        self._sglang = None
        self.profiler = WorkerProfiler(f"{ctx.role}_{ctx.rank}")

    async def on_start(self) -> None:
        logger.info("importing torch, %.1f s after the process started", seconds_since_launch())
        # seconds of imports (many more on a loaded machine): off the event loop, so heartbeats keep flowing
        await asyncio.to_thread(_import_engine_modules, self.kind)
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("MILES_TORCH_THREADS", "1"))))
        if self.kind == "sglang":
            from miles.engines.sglang_engine import SGLangServer, with_engine_dtype

            port = free_port(self.host)
            self._sglang = SGLangServer(
                self.model_path,
                port=port,
                host=self.host,
                sglang_args=with_engine_dtype(self.sglang_args, self.dtype),  # computes in what is pushed
                tp_size=self.tp_size,
                api_key=self.api_key,
            )
            self._sglang.start()
            await self._sglang.wait_healthy_async()
            return
        from miles.engines.embedded.engine import EmbeddedEngine
        from miles.engines.http_front import start_http_server
        from miles.weights.receiver import WeightReceiver

        # weights and KV cache are built off the event loop, so heartbeats keep flowing meanwhile
        self._engine = await asyncio.to_thread(
            EmbeddedEngine,
            self.model_path,
            device=self.device,
            dtype=self.dtype,
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.max_total_tokens,
            seed=self.seed,
            deterministic=self.deterministic,
            true_on_policy=self.true_on_policy,
            **embedded_options(self.sglang_args),
        )
        await self._engine.start()
        self._http = await start_http_server(
            self._engine,
            self.host,
            0,
            receiver=WeightReceiver(self._engine),
            api_key=self.api_key,
            max_body_mb=self.max_body_mb,
            weight_dirs=self.weight_dirs,
        )
        logger.info(
            "embedded engine serving at %s, %.1f s after its process started", self._http.url, seconds_since_launch()
        )
        freeze_heap("rollout engine ready")  # full collections would otherwise walk the whole model's heap

    def url(self) -> str:
        url = self._sglang.url if self._sglang is not None else self._http.url
        if "://0.0.0.0:" in url:  # bound on every interface: advertise an address other nodes can reach
            url = url.replace("0.0.0.0", socket.gethostbyname(socket.gethostname()))
        return url

    def info(self) -> dict[str, Any]:
        return {"url": self.url(), "kind": self.kind, "pid": os.getpid()}

    def start_profile(self, trace_dir: str, py_spy: bool = False) -> dict[str, str | None]:
        """torch.profiler records every thread of this process (the engine's included); with
        --engine sglang the server is a separate process: use its own profiler for GPU kernels."""
        return self.profiler.start(trace_dir, py_spy=py_spy)

    def stop_profile(self) -> dict[str, str | None]:
        return self.profiler.stop()

    async def on_stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
        if self._engine is not None:
            await self._engine.shutdown()
        if self._sglang is not None:
            await asyncio.to_thread(self._sglang.stop)
