"""The session server's HTTP front: the routes of a `Gateway` and the router's /generate, on one port.

Routes (JSON):
  POST   /sessions                              {metadata?, max_turns?} -> {session_id}
  GET    /sessions/{id}                         checkpoints with their token ids, masks, log-probs
  DELETE /sessions/{id}                         ends the session and frees its engine binding
  POST   /sessions/{id}/v1/chat/completions     one turn (OpenAI chat completions, tools included)
  POST   /sessions/{id}/samples                 {max_seq_len?, metadata?} -> {samples: [Sample dicts]}
  POST   /v1/chat/completions                   one turn in a new session of its own (any OpenAI client)
  GET    /v1/models, GET /health
  POST   /generate                              SGLang's /generate through the router (generate functions)

Sessions and turns are miles.agent.gateway's (routing, tokenisation, checkpoints); this module maps
its errors to statuses (404 unknown session, 409 conflict, 503 aborted or engine unavailable, 400
bad input) and passes /generate on with the caller's `X-SMG-Routing-Key`.

Limits, checked before parsing or tokenising: a body over `max_body_mb` is refused with 413 from
its Content-Length before it is read; a body over INLINE_PARSE_BYTES is parsed on the gateway's
CPU pool, not on the loop.

Access: with an API key, every route but GET /health wants `Authorization: Bearer <key>`, except
the routes of an existing session, where the unguessable session id in the path is the
credential (the base URL an agent function is given).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from miles.agent.gateway import Gateway, TurnAborted, UnknownSession
from miles.agent.openai_protocol import stream_events
from miles.agent.sessions import Session, SessionConflict
from miles.engines.client import ROUTING_KEY_HEADER, EngineConnectionError, EngineHTTPError, EngineTimeoutError
from miles.engines.doors import AUTH_HEADER, body_limit_middleware, loads_strict
from miles.engines.http_front import listen

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_MB = 64.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except UnknownSession as e:
        return _error(404, str(e), "not_found_error")
    except SessionConflict as e:
        return _error(409, str(e), "conflict_error")
    except TurnAborted as e:
        return _error(503, str(e), "aborted")
    except EngineHTTPError as e:
        return _error(e.status if 400 <= e.status < 500 else 502, str(e), "engine_error")
    except (EngineConnectionError, EngineTimeoutError) as e:
        return _error(503, str(e), "engine_unavailable")
    except ValueError as e:  # bad input, a missing routing key, a template that is not append-only
        logger.info("%s %s rejected: %s", request.method, request.path, e)
        return _error(400, str(e), "invalid_request_error")
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}", "server_error")


def _auth(api_key: str, gateway: Gateway) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/health" and request.method in ("GET", "HEAD"):
            return await handler(request)
        session_id = request.match_info.get("session_id")
        if session_id is not None and session_id in gateway.sessions:
            return await handler(request)  # the session id in the path is the credential
        if not hmac.compare_digest(request.headers.get(AUTH_HEADER, "").encode(), expected):
            return _error(
                401,
                f"{request.method} {request.path}: wants 'Authorization: Bearer <key>' with the server's API key",
                "authentication_error",
            )
        return await handler(request)

    return check


INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop: a thread hop costs more than they do


async def _body(request: web.Request, gateway: Gateway) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    body = loads_strict(raw) if len(raw) <= INLINE_PARSE_BYTES else await gateway.in_thread(loads_strict, raw)
    if not isinstance(body, dict):
        raise ValueError(f"{request.path} expects a JSON object body")
    return body


class _Routes:
    def __init__(self, gateway: Gateway) -> None:
        self.g = gateway

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.g.sessions)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.g.model_name, "object": "model", "owned_by": "miles"}]}
        )

    async def generate(self, request: web.Request) -> web.Response:
        out = await self.g.router.generate(
            await _body(request, self.g), routing_key=request.headers.get(ROUTING_KEY_HEADER)
        )
        return web.json_response(out)

    async def create(self, request: web.Request) -> web.Response:
        body = await _body(request, self.g)
        session = self.g.new_session(body.get("metadata"), body.get("max_turns"))
        return web.json_response({"session_id": session.id})

    async def show(self, request: web.Request) -> web.Response:
        return web.json_response(self.g.get(request.match_info["session_id"]).to_dict())

    async def delete(self, request: web.Request) -> web.Response:
        session = self.g.get(request.match_info["session_id"])
        self.g.close(session.id)
        return web.json_response({"deleted": session.id})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session = self.g.get(request.match_info["session_id"])
        return await self._answer(request, session)

    async def chat_once(self, request: web.Request) -> web.StreamResponse:
        session = self.g.new_session()
        try:
            return await self._answer(request, session)
        finally:
            self.g.close(session.id)

    async def _answer(self, request: web.Request, session: Session) -> web.StreamResponse:
        chat = await self.g.parse_chat(await _body(request, self.g))
        completion = await self.g.turn(session, chat)
        if not chat.stream:
            return web.json_response(completion)
        return web.Response(body=stream_events(completion), content_type="text/event-stream")

    async def samples(self, request: web.Request) -> web.Response:
        session = self.g.get(request.match_info["session_id"])
        body = await _body(request, self.g)
        max_seq_len = body.get("max_seq_len")
        samples = self.g.samples(session, max_seq_len=int(max_seq_len) if max_seq_len else None)
        for s in samples:
            s.metadata.update(body.get("metadata") or {})
        return web.json_response({"samples": [s.to_dict() for s in samples]})


def build_gateway_app(
    gateway: Gateway,
    *,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    max_body_flag: str = "--http-max-body-mb",
) -> web.Application:
    """`max_body_mb`: larger bodies get 413 naming `max_body_flag`, the flag that raises the limit."""
    max_bytes = int(max_body_mb * 2**20)
    middlewares = [body_limit_middleware(max_bytes, max_body_flag, "session server"), _errors]
    if api_key:
        middlewares.insert(0, _auth(api_key, gateway))
    app = web.Application(middlewares=middlewares, client_max_size=max_bytes)
    r = _Routes(gateway)
    add = app.router.add_route
    add("GET", "/health", r.health)
    add("GET", "/v1/models", r.models)
    add("POST", "/generate", r.generate)
    add("POST", "/v1/chat/completions", r.chat_once)
    add("POST", "/sessions", r.create)
    add("GET", "/sessions/{session_id}", r.show)
    add("DELETE", "/sessions/{session_id}", r.delete)
    add("POST", "/sessions/{session_id}/v1/chat/completions", r.chat)
    add("POST", "/sessions/{session_id}/samples", r.samples)
    return app


@dataclass(slots=True)
class GatewayHandle:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    gateway: Gateway | None = None

    async def stop(self) -> None:
        await self.runner.cleanup()
        if self.gateway is not None:
            self.gateway.shutdown()


async def start_gateway(
    gateway: Gateway,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: str | None = None,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    max_body_flag: str = "--http-max-body-mb",
) -> GatewayHandle:
    """Serve `gateway` on host:port (0: a free port) on the running loop (limits: see build_gateway_app)."""
    app = build_gateway_app(gateway, api_key=api_key, max_body_mb=max_body_mb, max_body_flag=max_body_flag)
    runner, bound = await listen(app, host, port, fix="pick another port for the session server")
    logger.info("session server listening on http://%s:%d (%s sessions)", host, bound, gateway.rule)
    return GatewayHandle(runner, host, bound, gateway)
