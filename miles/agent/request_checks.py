"""The limits of one chat-completions request, checked before any tokenising.

Roles: `system`, `developer`, `user`, `assistant`, `tool` (`ROLES`); anything else is refused, as
OpenAI does, instead of being rendered by a template that was never written for it.

Sampling parameters (`SAMPLING_LIMITS`, OpenAI's ranges where OpenAI states one):
temperature in [0, 2], top_p in (0, 1], top_k -1 (off) or an integer >= 1, min_p in [0, 1],
frequency and presence penalty in [-2, 2], repetition_penalty in (0, 2], seed an integer in
[0, 2**63), max_tokens an integer >= 1 and at most the server's context per request, at most
`MAX_STOP` stop strings of at most `MAX_STOP_CHARS` characters, at most `MAX_STOP_TOKEN_IDS` stop
token ids, each >= 0.

Size: the text of all messages (content, reasoning, tool-call arguments) and the tools' JSON may
hold at most `max_chars` characters, a bound the server derives from its context length and the
longest token of its vocabulary (text longer than that cannot fit the context, however it
tokenises), and at most `MAX_MESSAGES` messages.
"""

from __future__ import annotations

import json
import math
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096
MAX_STOP = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**63
# name -> (low, high, low included, high included)
SAMPLING_LIMITS: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, True, True),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "repetition_penalty": (0.0, 2.0, False, True),
}


def check_messages(raw: list[Any], tools: Any, max_chars: int) -> None:
    """Refuse (ValueError: HTTP 400) an unknown role, too many messages, or more text than can fit."""
    if len(raw) > MAX_MESSAGES:
        raise ValueError(f"'messages' holds {len(raw)} messages; the session server takes at most {MAX_MESSAGES}")
    chars = len(json.dumps(tools)) if tools else 0
    for i, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is not one of {list(ROLES)}")
        chars += _text_chars(message)
        if chars > max_chars:
            raise ValueError(
                f"the messages hold more than {max_chars} characters (over the limit at messages[{i}]): more text "
                f"than the server's context can hold however it tokenises; shorten the conversation"
            )


def _text_chars(message: dict[str, Any]) -> int:
    n = 0
    for key in ("content", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str):
            n += len(value)
        elif isinstance(value, list):
            n += sum(len(p.get("text", "")) if isinstance(p, dict) else len(str(p)) for p in value)
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            n += len(str(fn.get("arguments") or "")) + len(str(fn.get("name") or ""))
    return n


def check_sampling(body: dict[str, Any], max_new_tokens_limit: int | None) -> None:
    """Refuse (ValueError: HTTP 400) a sampling field outside its stated range (module docstring)."""
    for name, (low, high, low_in, high_in) in SAMPLING_LIMITS.items():
        value = body.get(name)
        if value is None:
            continue
        ok = (
            _is_number(value)
            and (low <= value if low_in else low < value)
            and (value <= high if high_in else value < high)
        )
        if not ok:
            interval = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            raise ValueError(f"{name}={value!r} must be a number in {interval}")
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k == -1 or top_k >= 1)):
        raise ValueError(f"top_k={top_k!r} must be -1 (off) or an integer >= 1")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < MAX_SEED):
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**63)")
    for name in ("max_tokens", "max_completion_tokens"):
        _check_max_tokens(name, body.get(name), max_new_tokens_limit)
    _check_stops(body.get("stop"), body.get("stop_token_ids"))
    for name in ("stream", "logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ValueError(f"{name}={body[name]!r} must be true or false")


def _check_max_tokens(name: str, value: Any, limit: int | None) -> None:
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if limit is not None and value > limit:
        raise ValueError(f"{name}={value} is over the server's context of {limit} tokens per request; ask for fewer")


def _check_stops(stop: Any, stop_ids: Any) -> None:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"stop={stop!r:.80} must be a string or a list of strings")
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids={stop_ids!r:.80} must be a list of token ids (integers >= 0)")
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(stop_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def max_text_chars(tokenizer: Any, context_len: int | None, fallback: int) -> int:
    """The most characters of text that can fit `context_len` tokens: context x the vocabulary's longest token
    (a token's string form is at least as long as the text it decodes to); `fallback` without a context."""
    if not context_len:
        return fallback
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return context_len * max(longest, 1)
