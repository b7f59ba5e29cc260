"""The rollout gateway: the session server (TITO) and the router's /generate, on one HTTP port.

Routes (JSON):
  POST   /sessions                              {metadata?, max_turns?} -> {session_id}
  GET    /sessions/{id}                         checkpoints with their token ids, masks, log-probs
  DELETE /sessions/{id}                         ends the session and frees its engine binding
  POST   /sessions/{id}/v1/chat/completions     one turn (OpenAI chat completions, tools included)
  POST   /sessions/{id}/samples                 {max_seq_len?, metadata?} -> {samples: [Sample dicts]}
  POST   /v1/chat/completions                   one turn in a new session of its own (any OpenAI client)
  GET    /v1/models, GET /health
  POST   /generate                              SGLang's /generate through the router (generate functions)

Every engine request carries the routing key `X-SMG-Routing-Key`: the session id for a turn, the
caller's header for /generate. A session's first turn goes to the least-loaded engine and every
later turn to the same one. A turn's token ids are built by `TitoTokenizer` (server-owned
tokenisation), its reply tokens are the engine's own, and the checkpoint stores both.

Work off the event loop: parsing a body and tokenising run on a pool of `cpu_threads` threads
(bounded), so one large request holds one thread while other sessions go on. Limits, checked before
parsing or tokenising: a body over `max_body_mb` is refused with 413 from its Content-Length before
it is read; roles, sampling ranges and the text one request may hold are checked after parsing and
before tokenising (400; miles.agent.request_checks states them).

Access: with an API key, every route but GET /health wants `Authorization: Bearer <key>`, except
the routes of an existing session, where the unguessable session id in the path is the
credential (the base URL an agent function is given).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from miles.agent.matchers import Matcher, strict
from miles.agent.openai_protocol import (
    DEFAULT_MAX_CHARS,
    ChatDefaults,
    ChatRequest,
    chat_completion,
    finish_reason,
    parse_chat_request,
    stream_events,
    token_logprobs,
)
from miles.agent.request_checks import max_text_chars
from miles.agent.sessions import RULES, Checkpoint, Session, SessionConflict, checkpoint_to_sample
from miles.agent.tito import TitoTokenizer
from miles.engines.client import ROUTING_KEY_HEADER, EngineConnectionError, EngineHTTPError, EngineTimeoutError
from miles.engines.doors import AUTH_HEADER, body_limit_middleware, loads_strict
from miles.engines.http_front import listen
from miles.rollout.generate import parse_output, record_routing
from miles.rollout.sample import Sample

logger = logging.getLogger(__name__)

DEFAULT_CPU_THREADS = min(4, os.cpu_count() or 1)
DEFAULT_MAX_BODY_MB = 64.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class UnknownSession(LookupError):
    """A session id the server does not hold (HTTP 404)."""


class TurnAborted(RuntimeError):
    """The engine aborted the turn (the rollout ended); the turn is stored, the agent should stop (HTTP 503)."""


@dataclass(slots=True)
class _Prepared:
    parent: Checkpoint | None
    input_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[int]
    max_new_tokens: int


class Gateway:
    """Sessions over a router (`generate(payload, routing_key=)`, `release_key(key)`); `tito=None`: /generate only."""

    def __init__(
        self,
        router: Any,
        tito: TitoTokenizer | None,
        *,
        rule: str = "linear",
        matcher: Matcher = strict,
        defaults: ChatDefaults | None = None,
        max_turns: int = 16,
        model_name: str = "miles",
        cpu_threads: int = DEFAULT_CPU_THREADS,
    ) -> None:
        if rule not in RULES.values():
            raise ValueError(f"session rule {rule!r} is not one of {sorted(RULES.values())}")
        self.router = router
        self.tito = tito
        self.rule = rule
        self.matcher = matcher
        self.defaults = defaults or ChatDefaults()
        self.max_turns = max_turns
        self.model_name = model_name
        self.sessions: dict[str, Session] = {}
        # the text one request may hold: more cannot fit the context, however it tokenises
        self.max_chars = (
            max_text_chars(tito.tokenizer, self.defaults.max_context_len, DEFAULT_MAX_CHARS)
            if tito
            else DEFAULT_MAX_CHARS
        )
        if cpu_threads < 1:
            raise ValueError(f"cpu_threads={cpu_threads} must be >= 1")
        # Parsing and tokenising are CPU work: off the event loop, on a bounded pool, so one large request
        # holds one thread, not every session. The threads share the tokenizer: every call encodes with the
        # same (no) truncation and padding, so the fast tokenizer's state is only read, never changed.
        self._cpu = ThreadPoolExecutor(max_workers=cpu_threads, thread_name_prefix="miles-tito")

    def shutdown(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # ---- sessions -------------------------------------------------------------------------------
    def new_session(self, metadata: dict[str, Any] | None = None, max_turns: int | None = None) -> Session:
        if self.tito is None:
            raise ValueError(
                "the session server is off in this run (only /generate is served); start it with --use-session-server"
            )
        session = Session(self.rule, self.matcher, max_turns or self.max_turns, metadata=dict(metadata or {}))
        self.sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"no session {session_id!r} (ended, or never created: POST /sessions first)")
        return session

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        release = getattr(self.router, "release_key", None)
        if release is not None:
            release(session_id)

    def samples(self, session: Session, *, max_seq_len: int | None = None) -> list[Any]:
        return [checkpoint_to_sample(leaf, self.tito.tokenizer, max_seq_len=max_seq_len) for leaf in session.leaves()]

    # ---- one turn -------------------------------------------------------------------------------
    async def turn(self, session: Session, request: ChatRequest) -> dict[str, Any]:
        """Attach, tokenise the suffix, generate on the session's engine, store the checkpoint."""
        if session.rule == "linear":  # one request at a time: each extends what the last one stored
            async with session.lock:
                prepared = await self._in_thread(self._prepare, session, request)
                return await self._generate_and_store(session, request, prepared)
        async with session.lock:
            prepared = await self._in_thread(self._prepare, session, request)
        return await self._generate_and_store(session, request, prepared)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def parse_chat(self, body: dict[str, Any]) -> ChatRequest:
        """The checked request (roles, sampling ranges, size), on the pool: normalising copies the text."""
        return await self._in_thread(parse_chat_request, body, self.defaults, self.max_chars)

    def _prepare(self, session: Session, request: ChatRequest) -> _Prepared:
        parent = session.attach(request.messages, request.tools)
        if parent is None:
            input_ids = self.tito.prompt_ids(request.messages, request.tools)
            base_ids, base_mask, base_lps, base_versions = [], [], [], []
        else:
            suffix = self.tito.suffix_ids(
                request.messages, len(parent.messages), request.tools, closed_turn=parent.closed_turn
            )
            input_ids = parent.token_ids + suffix
            base_ids, base_mask, base_lps = parent.token_ids, parent.loss_mask, parent.log_probs
            base_versions = parent.weight_versions
        appended = len(input_ids) - len(base_ids)
        fill_version = base_versions[-1] if base_versions else 0
        max_new = int(request.sampling_params["max_new_tokens"])
        if self.defaults.max_context_len is not None:
            max_new = min(max_new, self.defaults.max_context_len - len(input_ids))
        return _Prepared(
            parent,
            input_ids,
            base_mask + [0] * appended,
            base_lps + [0.0] * appended,
            base_versions + [fill_version] * appended,
            max(max_new, 0),
        )

    async def _generate_and_store(self, session: Session, request: ChatRequest, p: _Prepared) -> dict[str, Any]:
        ids, lps, versions, finish, routed = await self._engine_turn(session, request, p)
        message = (
            self.tito.parse_reply(ids)
            if request.parse_tools
            else {
                "role": "assistant",
                "content": self.tito.tokenizer.decode(
                    ids[:-1] if ids and ids[-1] == self.tito.end_of_turn_id else ids, skip_special_tokens=False
                ),
            }
        )
        if not p.parent:  # the prompt's positions take the version of the first generated token
            p.weight_versions = [versions[0] if versions else 0] * len(p.input_ids)
        checkpoint = Checkpoint(
            index=session.next_index(),
            parent=p.parent,
            messages=request.messages + [message],
            token_ids=p.input_ids + ids,
            loss_mask=p.loss_mask + [1] * len(ids),
            log_probs=p.log_probs + lps,
            weight_versions=p.weight_versions + versions,
            finish_reason=finish,
            closed_turn=bool(ids) and ids[-1] == self.tito.end_of_turn_id,
            input_len=len(p.input_ids),
            turns=(p.parent.turns if p.parent else 0) + 1,
            tools=request.tools,
            routed=routed,
        )
        async with _maybe_locked(session):
            session.add(checkpoint)
        if finish == "abort":
            raise TurnAborted(
                f"session {session.id}: the engine aborted the turn (the rollout step ended); the episode is over"
            )
        return chat_completion(
            message,
            finish=finish_reason(finish, message),
            model=self.model_name,
            prompt_tokens=len(p.input_ids),
            completion_tokens=len(ids),
            logprobs=token_logprobs(self.tito.tokenizer, ids, lps) if request.logprobs else None,
        )

    async def _engine_turn(
        self, session: Session, request: ChatRequest, p: _Prepared
    ) -> tuple[list[int], list[float], list[int], str, np.ndarray | None]:
        """(ids, log-probs, versions, finish type, R3's routed experts of input + ids but the last, or None)."""
        if p.max_new_tokens == 0:  # the context is full: a turn of nothing, stopped at the length limit
            return [], [], [], "length", None
        params = dict(request.sampling_params, max_new_tokens=p.max_new_tokens)
        params["stop_token_ids"] = sorted({*params.get("stop_token_ids", ()), self.tito.end_of_turn_id})
        payload = {
            "input_ids": p.input_ids,
            "sampling_params": params,
            "return_logprob": True,
            "rid": f"{session.id}-{uuid.uuid4().hex[:8]}",
        }
        if self.defaults.routing is not None:
            payload["return_routed_experts"] = True
        out = await self.router.generate(payload, routing_key=session.id)
        ids, lps, versions, finish = parse_output(out)
        if len(lps) != len(ids) or len(versions) != len(ids):
            raise RuntimeError(
                f"the engine returned {len(ids)} tokens with {len(lps)} log-probs and "
                f"{len(versions)} versions; the turn cannot be recorded"
            )
        routed = None
        if self.defaults.routing is not None:
            holder = Sample(tokens=p.input_ids + ids)
            record_routing(holder, out, self.defaults.routing)
            routed = holder.rollout_routed_experts
        return ids, lps, versions, finish, routed


class _maybe_locked:
    """The session's lock, unless this task holds it already (linear sessions hold it for the whole turn)."""

    def __init__(self, session: Session) -> None:
        self.lock = session.lock if session.rule != "linear" else None

    async def __aenter__(self) -> None:
        if self.lock is not None:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self.lock is not None:
            self.lock.release()


# ---------------------------------------------------------------- HTTP


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
    body = loads_strict(raw) if len(raw) <= INLINE_PARSE_BYTES else await gateway._in_thread(loads_strict, raw)
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
