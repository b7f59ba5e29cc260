"""The session server's logic: sessions over the router, and a turn's tokens, generation and checkpoint.

`Gateway` holds the sessions and answers for them whatever front calls it (miles.agent.server is
the HTTP one). A turn's engine request carries the routing key `X-SMG-Routing-Key` = the session
id: a session's first turn goes to the least-loaded engine and every later turn to the same one. A
turn's token ids are built by `TitoTokenizer` (server-owned tokenisation), its reply tokens are the
engine's own, and the checkpoint stores both. `close` frees the session's engine binding.

Work off the event loop: parsing a request and tokenising run on a pool of `cpu_threads` threads
(bounded, `in_thread`), so one large request holds one thread while other sessions go on. Roles,
sampling ranges and the text one request may hold are checked when parsing, before tokenising
(ValueError; miles.agent.request_checks states them).

Errors a front maps to statuses: `UnknownSession` (no such session), `SessionConflict` (from
miles.agent.sessions), `TurnAborted` (the engine aborted; the turn is stored), ValueError (bad input).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.agent.matchers import Matcher, strict
from miles.agent.openai_protocol import (
    DEFAULT_MAX_CHARS,
    ChatDefaults,
    ChatRequest,
    chat_completion,
    finish_reason,
    parse_chat_request,
    token_logprobs,
)
from miles.agent.request_checks import max_text_chars
from miles.agent.sessions import RULES, Checkpoint, Session, checkpoint_to_sample
from miles.agent.tito import TitoTokenizer
from miles.rollout.generate import parse_output, record_routing
from miles.rollout.sample import Sample

DEFAULT_CPU_THREADS = min(4, os.cpu_count() or 1)


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
                prepared = await self.in_thread(self._prepare, session, request)
                return await self._generate_and_store(session, request, prepared)
        async with session.lock:
            prepared = await self.in_thread(self._prepare, session, request)
        return await self._generate_and_store(session, request, prepared)

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the gateway's CPU pool (fronts parse large bodies here too)."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def parse_chat(self, body: dict[str, Any]) -> ChatRequest:
        """The checked request (roles, sampling ranges, size), on the pool: normalising copies the text."""
        return await self.in_thread(parse_chat_request, body, self.defaults, self.max_chars)

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
