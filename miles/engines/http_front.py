"""HTTP front of the embedded engine: SGLang's server endpoints and JSON payloads.

Every endpoint Miles calls on an SGLang server is answered here with the same method, body and
reply shape, so `EngineClient` (and any SGLang client) cannot tell the two apart. Generation and
control map one-to-one onto `EmbeddedEngine`; weight-update endpoints go to the engine-side
`WeightReceiver`. Deliberate differences from SGLang are listed in docs/engines.md.

Errors: a ValueError (bad input) becomes HTTP 400, a path outside the engine's weight directories
403, anything else 500, all with {"error": message, "success": false, "message": message}, which
carries both our contract's `error` key and the `success`/`message` pair SGLang's weight endpoints
answer with (the handlers and that mapping: http_handlers.py). Who may call, how large a body may be
and which paths a request may name are decided in `miles.engines.doors` (401 without the key, 413
over the size limit). `miles engine serve` (`serve_main`) runs this front over a new engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from miles.config import EMBEDDED_KV_CACHE_DTYPES, ranged
from miles.config import NUMBER_RANGES as R
from miles.engines.doors import (
    DEFAULT_MAX_BODY_MB,
    WeightDirs,
    api_key_middleware,
    body_limit_middleware,
    warn_if_open,
)
from miles.engines.http_handlers import EngineFront, error_middleware

logger = logging.getLogger(__name__)


WEIGHT_ENDPOINTS = (
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "update_weights_from_disk",
    "pull_weights",
    "weights_checker",
    "load_lora_adapter_from_distributed",
    "load_lora_adapter_from_tensors",
    "unload_lora_adapter",
)


# Miles-only (real SGLang lacks them, so the colocated updater falls back to per-bucket handoffs there):
# POST /miles/export_weight_buffer -> the engine's shared weight buffer (handle, generation, per-name
# offset/shape/stride/dtype); POST /miles/install_weight_buffer {generation, weight_version} after the
# trainer wrote into it. See miles/weights/colocated_direct.py.
MILES_WEIGHT_ENDPOINTS = ("export_weight_buffer", "install_weight_buffer")


FRONT_KEY = web.AppKey("front", EngineFront)


def build_app(
    engine: Any,
    receiver: Any = None,
    *,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    weight_dirs: Iterable[str] = (),
    max_body_flag: str = "--http-max-body-mb",
) -> web.Application:
    """The aiohttp application serving `engine` with SGLang's endpoints.

    `api_key`: required as `Authorization: Bearer <key>` on every endpoint but GET /health (None:
    open). `max_body_mb`: larger bodies get 413 naming `max_body_flag`. `weight_dirs`: the directories `/pull_weights` and
    `/update_weights_from_disk` may name (besides the engine's own model path, readable).
    """
    front = EngineFront(engine, receiver, WeightDirs.of(weight_dirs, getattr(engine, "model_path", None)))
    max_bytes = int(max_body_mb * 2**20)
    middlewares = [body_limit_middleware(max_bytes, max_body_flag), error_middleware]
    if api_key:
        middlewares.insert(0, api_key_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=max_bytes)
    app[FRONT_KEY] = front
    app.on_cleanup.append(_detach_front)
    add = app.router.add_route
    for method in ("POST", "PUT"):
        add(method, "/generate", front.generate)
    add("POST", "/abort_request", front.abort_request)
    add("POST", "/pause_generation", front.pause_generation)
    add("POST", "/continue_generation", front.continue_generation)
    for method in ("GET", "POST"):
        add(method, "/flush_cache", front.flush_cache)
        add(method, "/release_memory_occupation", front.release_memory_occupation)
        add(method, "/resume_memory_occupation", front.resume_memory_occupation)
    add("GET", "/health", front.health)
    add("GET", "/health_generate", front.health_generate)
    add("GET", "/model_info", front.model_info)
    add("GET", "/get_model_info", front.model_info)
    add("GET", "/get_weight_version", front.get_weight_version)
    add("GET", "/server_info", front.server_info)
    add("GET", "/get_server_info", front.server_info)
    add("POST", "/update_weight_version", front.update_weight_version)
    for name in WEIGHT_ENDPOINTS:
        add("POST", f"/{name}", front.weights_route(name))
    for name in MILES_WEIGHT_ENDPOINTS:
        add("POST", f"/miles/{name}", front.weights_route(name))
    return app


async def _detach_front(app: web.Application) -> None:
    app[FRONT_KEY].detach()


@dataclass(slots=True)
class HttpServerHandle:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http_server(
    engine: Any,
    host: str,
    port: int,
    receiver: Any = None,
    *,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    weight_dirs: Iterable[str] = (),
    max_body_flag: str = "--http-max-body-mb",
) -> HttpServerHandle:
    """Serve `engine` on host:port (port 0 picks a free one) on the running loop (doors: see build_app)."""
    warn_if_open(host, api_key)
    app = build_app(
        engine,
        receiver,
        api_key=api_key,
        max_body_mb=max_body_mb,
        weight_dirs=weight_dirs,
        max_body_flag=max_body_flag,
    )
    runner, bound_port = await listen(
        app, host, port, fix="pick another --port (0 picks a free one)", shutdown_timeout=5.0
    )
    logger.info("engine HTTP front listening on http://%s:%d", host, bound_port)
    return HttpServerHandle(runner=runner, host=host, port=bound_port)


async def listen(
    app: web.Application, host: str, port: int, *, fix: str, **runner_kwargs: Any
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: a free port) on the running loop; returns the runner and the bound port.

    A port that cannot be bound raises OSError naming the address and `fix`. Handlers are cancelled when
    their client disconnects (for /generate that aborts the request).
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **runner_kwargs)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {exc}; {fix}") from exc
    return runner, runner.addresses[0][1]


def parse_engine_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="miles engine serve", description="Serve the embedded engine over HTTP.")
    parser.add_argument("--model-path", required=True, help="HF model directory (weights + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    parser.add_argument("--port", type=ranged(int, R["controller_port"][0]), default=30000, help="0 picks a free port")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-running-requests", type=ranged(int, R["max_running_requests"][0]), default=64)
    parser.add_argument("--max-total-tokens", type=ranged(int, R["max_total_tokens"][0]), default=None)
    parser.add_argument("--seed", type=ranged(int, R["seed"][0]), default=0)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn prefix sharing off (as SGLang's flag: no KV shared between requests with a common prefix)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=EMBEDDED_KV_CACHE_DTYPES,
        default="auto",
        help="what the KV cache stores, as SGLang's flag: auto (the model's dtype), or FP8 with scale 1 "
        "(half a bf16 cache's bytes)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but GET /health (default: open; "
        "then keep the default loopback --host)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=ranged(float, R["http_max_body_mb"][0]),
        default=DEFAULT_MAX_BODY_MB,
        help="largest request body in MiB (413 above)",
    )
    parser.add_argument(
        "--weight-dir",
        action="append",
        default=[],
        help="a directory /pull_weights and /update_weights_from_disk may use (repeatable; "
        "the served --model-path is always readable)",
    )
    return parser.parse_args(argv)


def engine_from_args(args: argparse.Namespace):
    """The embedded engine the serving commands' shared flags describe (`miles engine serve`, `miles session serve`)."""
    from miles.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        seed=args.seed,
        deterministic=getattr(args, "deterministic", False),
        prefix_cache=not getattr(args, "disable_radix_cache", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
    )


async def _serve(args: argparse.Namespace) -> None:
    engine = engine_from_args(args)
    await engine.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    handle = None
    try:
        handle = await start_http_server(
            engine,
            args.host,
            args.port,
            api_key=args.api_key,
            max_body_mb=args.max_body_mb,
            weight_dirs=[os.path.abspath(d) for d in args.weight_dir],
            max_body_flag="--max-body-mb",
        )
        # One parseable line on stdout: launchers read the bound port from it.
        print(f"miles engine serving {args.model_path} on {handle.url}", flush=True)
        await stop.wait()
    finally:
        if handle is not None:
            await handle.stop()
        await engine.shutdown()


def serve_main(argv: list[str] | None = None) -> int:
    """`miles engine serve`: run the embedded engine's HTTP front until SIGINT/SIGTERM."""
    args = parse_engine_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_main())
