"""The request handlers of the embedded engine's HTTP front: each SGLang endpoint's JSON body in, the call
on `EmbeddedEngine` (or its weight receiver), SGLang's reply out.

Errors: a ValueError (bad input) becomes HTTP 400, a path outside the engine's weight directories
403, an unavailable weight receiver 501, anything else 500, all with {"error": message, "success":
false, "message": message} (`error_middleware`). The routes and the server are http_front.py's.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from typing import Any

from aiohttp import web

from miles.engines.doors import PathRefused, WeightDirs, json_error, loads_strict
from miles.engines.sglang_protocol import PAUSE_MODES, check_request_fields, parse_generate_body
from miles.weights.verify import CHECKER_ACTIONS

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
INLINE_PARSE_BYTES = 64 * 1024
EMBEDDED_VERSION = "miles-embedded"  # /server_info "version" (SGLang reports its release there)
# Memory tags SGLang knows that the embedded engine has no use for (it captures no CUDA graphs).
IGNORED_MEMORY_TAGS = frozenset({"cuda_graph"})


class ReceiverUnavailable(RuntimeError):
    """The weight receiver module cannot be imported (answered with HTTP 501)."""


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ReceiverUnavailable as exc:
        return json_error(501, str(exc))
    except PathRefused as exc:
        logger.warning("%s %s refused: %s", request.method, request.path, exc)
        return json_error(403, str(exc))
    except ValueError as exc:  # includes malformed JSON (JSONDecodeError)
        logger.info("%s %s rejected: %s", request.method, request.path, exc)
        return json_error(400, str(exc))
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return json_error(500, f"{type(exc).__name__}: {exc}")


async def _json_body(request: web.Request) -> dict:
    """The JSON object body; for an endpoint SGLang has, only fields its request class has (see sglang_protocol)."""
    body = await _read_json(request)
    check_request_fields(request.path.lstrip("/"), body)
    return body


async def _read_json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    raw = await request.read()
    if not raw.strip():
        return {}
    # a large body parses on the default (bounded) pool: the loop keeps serving other requests meanwhile
    body = loads_strict(raw) if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(loads_strict, raw)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ValueError(f"{request.path} expects a JSON object body, got {type(body).__name__}")
    return body


class EngineFront:
    """Request handlers bound to one engine (and, lazily, its weight receiver)."""

    def __init__(self, engine: Any, receiver: Any = None, weight_dirs: WeightDirs | None = None) -> None:
        self._engine = engine
        self._receiver = receiver
        self.weight_dirs = weight_dirs or WeightDirs.of((), getattr(engine, "model_path", None))
        self.paused = False

    @property
    def engine(self) -> Any:
        if self._engine is None:
            raise RuntimeError("this HTTP front is stopped: it no longer serves an engine")
        return self._engine

    def detach(self) -> None:
        """Let go of the engine and the weight receiver once the server stopped.

        aiohttp (>= 3.10.6) caches every application's middleware-wrapped handlers in a module-level
        LRU (up to 1024 entries) that outlives the application; each handler is bound to this front,
        so without this a stopped front keeps its engine (weights, KV cache) alive for as long as the
        process runs, one engine per server started in it.
        """
        self._engine = self._receiver = None

    # -- generation -------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        calls, is_batch = parse_generate_body(body)
        try:
            results = await asyncio.gather(*(self.engine.generate(**call) for call in calls))
        except BaseException:
            # The client went away, or one prompt of a batch failed: free the engine's slots
            # instead of finishing work nobody will read.
            for call in calls:
                try:
                    self.engine.abort(call["rid"])
                except Exception:
                    logger.exception("aborting %s after a failed /generate failed too", call["rid"])
            raise
        if body.get("return_text_in_logprobs"):
            for result in results:
                for out in result if isinstance(result, list) else [result]:
                    self._add_logprob_texts(out["meta_info"])
        if not is_batch:
            return web.json_response(results[0])
        flat = [out for result in results for out in (result if isinstance(result, list) else [result])]
        return web.json_response(flat)

    def _add_logprob_texts(self, meta_info: dict) -> None:
        tokenizer = self.engine.tokenizer
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for entry in meta_info.get(key) or []:
                entry[2] = tokenizer.decode([entry[1]])
        for side in ("output", "input"):  # per position, a list of entries
            for key in (f"{side}_top_logprobs", f"{side}_token_ids_logprobs"):
                for position in meta_info.get(key) or []:
                    for entry in position or []:
                        entry[2] = tokenizer.decode([entry[1]])

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        rid, abort_all = body.get("rid") or None, bool(body.get("abort_all", False))
        if rid is None and not abort_all:
            raise ValueError("/abort_request needs 'rid' or 'abort_all': true")
        self.engine.abort(rid=rid, abort_all=abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _json_body(request)).get("mode", "abort")  # SGLang's default mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"/pause_generation mode={mode!r}; expected one of {list(PAUSE_MODES)}")
        await self.engine.pause_generation(mode)
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.continue_generation()
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(text="Cache not flushed: requests are still running or waiting.\n", status=400)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._memory_tags(await _json_body(request))
        if tags != []:
            self.engine.release_memory_occupation(tags)
        return web.json_response({"success": True, "message": f"released {tags or 'all'}"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = self._memory_tags(await _json_body(request))
        if tags != []:
            self.engine.resume_memory_occupation(tags)
        return web.json_response({"success": True, "message": f"resumed {tags or 'all'}"})

    @staticmethod
    def _memory_tags(body: dict) -> list[str] | None:
        """None = every tag (SGLang's null); [] = nothing left to do once SGLang-only tags are dropped."""
        tags = body.get("tags")
        if tags is None:
            return None
        if not isinstance(tags, list):
            raise ValueError(f"memory occupation 'tags' must be a list or null, got {tags!r}")
        return [t for t in tags if t not in IGNORED_MEMORY_TAGS]

    # -- info and health --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        # A busy or deliberately paused engine is alive; a one-token probe would only queue behind it.
        if self.paused or self.engine.num_active_requests > 0:
            return web.Response(status=200)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        probe = self.engine.generate(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid)
        try:
            await asyncio.wait_for(probe, timeout=HEALTH_GENERATE_TIMEOUT_S)
        except Exception:
            logger.exception("health_generate probe failed")
            self.engine.abort(rid)
            return web.Response(status=503)
        return web.Response(status=200)

    def _model_info(self) -> dict:
        info = dict(self.engine.model_info())
        info["weight_version"] = str(info.get("weight_version", self.engine.weight_version))
        return info

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info())

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    async def server_info(self, request: web.Request) -> web.Response:
        info = self._model_info()
        for name in ("max_running_requests", "max_total_tokens", "device", "dtype", "seed", "deterministic"):
            value = getattr(self.engine, name, None)
            if isinstance(value, (int, float, str, bool)):
                info[name] = value
        info.update(
            version=EMBEDDED_VERSION,
            tp_size=1,  # one device: one rank in a weight-sync group
            weights_checker_actions=list(CHECKER_ACTIONS),  # --check-weight-update-equal probes for fill_noise
            internal_states=[{"num_active_requests": self.engine.num_active_requests, "paused": self.paused}],
        )
        return web.json_response(info)

    # -- weights (engine-side receiver) -----------------------------------------------------------

    def receiver(self) -> Any:
        if self._receiver is None:
            try:
                from miles.weights.receiver import WeightReceiver
            except ImportError as exc:
                raise ReceiverUnavailable(
                    f"weight updates are unavailable: miles.weights.receiver cannot be imported ({exc})"
                ) from exc
            self._receiver = WeightReceiver(self.engine)
        return self._receiver

    def weights_route(self, method_name: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            body = await _json_body(request)
            method = getattr(self.receiver(), method_name)
            if body.get("abort_all_requests"):  # SGLang aborts every request before it changes the weights
                self.engine.abort(abort_all=True)
            try:
                inspect.signature(method).bind(**body)
            except TypeError as exc:
                raise ValueError(f"/{method_name} payload {sorted(body)} does not match: {exc}") from exc
            self.weight_dirs.check(method_name, body)
            result = await method(**body)
            content = {"success": True, "message": f"{method_name} done"}
            if isinstance(result, dict):
                content.update(result)
            return web.json_response(content)

        return handler

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if "new_version" not in body:
            raise ValueError("/update_weight_version needs 'new_version'")
        new_version = str(body["new_version"])
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        try:
            receiver = self.receiver()
        except ReceiverUnavailable:
            receiver = None
        if receiver is not None:
            await receiver.update_weight_version(new_version)
        else:  # the version is engine state; setting it needs no transport
            self.engine.weight_version = _int_version(new_version)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}
        )


def _int_version(version: str) -> int:
    try:
        return int(version)
    except ValueError as exc:
        raise ValueError(f"weight version {version!r} is not an integer; miles versions are 0, 1, 2, ...") from exc
