"""The OpenAI chat-completions wire format the session server speaks: requests in, replies out.

Requests are parsed into the messages, tools and the engine's sampling parameters
(`max_tokens`/`max_completion_tokens` -> `max_new_tokens`, `seed` -> `sampling_seed`, `top_k`,
`min_p` and the penalties passed through). Fields the server cannot honour are refused with a
message instead of being dropped: `n` > 1, `logit_bias`, `top_logprobs`, `response_format`
other than text, a `tool_choice` other than auto or none. `stream` is answered as one chunk
followed by `[DONE]`, as Miles does. Roles, sampling ranges and sizes are checked first
(miles.agent.request_checks), before anything is tokenised.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles.agent.request_checks import check_messages, check_sampling
from miles.agent.tito import normalize_message
from miles.utils.routing import RoutingShape

DEFAULT_MAX_CHARS = 4 * 2**20  # the text of one request when the server knows no context length

_PASSED_THROUGH = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


@dataclass(slots=True)
class ChatDefaults:
    """Sampling used where a request says nothing; `max_context_len` caps prompt + new tokens of a turn."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 256
    max_context_len: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    routing: RoutingShape | None = None  # R3: every turn asks the engine for its routed experts


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling_params: dict[str, Any]
    parse_tools: bool
    stream: bool
    logprobs: bool


def parse_chat_request(
    body: dict[str, Any], defaults: ChatDefaults, max_chars: int = DEFAULT_MAX_CHARS
) -> ChatRequest:
    """Validate one /v1/chat/completions body; ValueError (HTTP 400) says what to change.

    `max_chars`: the most characters of message text (and tools' JSON) one request may hold."""
    _refuse_unsupported(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list of tool specs")
    check_messages(raw, tools, max_chars)
    check_sampling(body, defaults.max_context_len)
    params: dict[str, Any] = {
        "temperature": body.get("temperature", defaults.temperature),
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "min_p": defaults.min_p,
        "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or defaults.max_tokens,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    params.update({k: body[k] for k in _PASSED_THROUGH if body.get(k) is not None})
    stop = body.get("stop", defaults.stop)
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    stop_ids = body.get("stop_token_ids", defaults.stop_token_ids)
    if stop_ids:
        params["stop_token_ids"] = [int(t) for t in stop_ids]
    if body.get("seed") is not None:
        params["sampling_seed"] = int(body["seed"])
    return ChatRequest(
        messages=[normalize_message(m) for m in raw],
        tools=tools,
        sampling_params=params,
        parse_tools=body.get("tool_choice", "auto") != "none",
        stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ValueError(f"n={n!r}: one choice per request; send n requests")
    if body.get("logit_bias"):
        raise ValueError("logit_bias is not supported by the session server")
    if body.get("top_logprobs"):
        raise ValueError("top_logprobs is not supported; logprobs=true returns the sampled tokens' log-probs")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ValueError(f"response_format={fmt!r} is not supported (plain text only)")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ValueError(
            f"tool_choice={choice!r} is not supported: the model decides (auto) or no calls are parsed (none)"
        )


def finish_reason(engine_finish: str, message: dict[str, Any]) -> str:
    if engine_finish == "length":
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def chat_completion(
    message: dict[str, Any],
    *,
    finish: str,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
    }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """OpenAI's per-token log-prob entries for the sampled tokens (no alternatives)."""
    out = []
    for token_id, lp in zip(ids, logprobs, strict=True):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def stream_events(completion: dict[str, Any]) -> bytes:
    """A finished completion as server-sent events: one chunk with the whole message, then [DONE]."""
    choice = completion["choices"][0]
    delta = {k: v for k, v in choice["message"].items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    chunk = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"], "logprobs": None}],
        "usage": completion["usage"],
    }
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
