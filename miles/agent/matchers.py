"""Whether a replayed message counts as the message the session stored at that position.

An agent sends its whole history on every turn; the session server compares each replayed
message with the stored one before it reuses the stored tokens. When the matcher says "same",
the stored token ids stay authoritative and only the new suffix is tokenised; otherwise the
history diverged there (a linear session rolls back or refuses, a branching one forks).

  strict             role, content, reasoning content, tool calls (id, name, arguments text),
                     tool_call_id and name: the fields chat templates read. The default.
  loose_tool_call    as strict, but tool-call arguments compare as JSON values, so a harness that
                     re-serialises them ('{"a":1}' for '{"a": 1}', '{}' for absent) still matches;
                     ids, names and order must agree.
  role_content_only  role and visible text only. Loosest: two turns that called different tools
                     with the same (often empty) text count as the same, and the stored call wins.
A dotted path names a custom `fn(stored: dict, replayed: dict) -> bool`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from miles.agent.tito import message_text
from miles.utils.misc import PluginError, load_function

Matcher = Callable[[dict[str, Any], dict[str, Any]], bool]


def _arguments_value(arguments: Any) -> Any:
    if arguments in (None, ""):
        return {}
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # not JSON: compared as text
    return arguments


def _calls(message: dict[str, Any], *, parse_arguments: bool) -> list[tuple[Any, ...]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = _arguments_value(args) if parse_arguments else ("{}" if args in (None, "") else args)
        out.append((call.get("id"), fn.get("name"), args))
    return out


def _template_fields(message: dict[str, Any]) -> tuple[Any, ...]:
    return (
        message.get("role"),
        message_text(message.get("content")),
        message_text(message.get("reasoning_content")),
        message.get("tool_call_id"),
        message.get("name"),
    )


def strict(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    return _template_fields(stored) == _template_fields(replayed) and _calls(stored, parse_arguments=False) == _calls(
        replayed, parse_arguments=False
    )


def loose_tool_call(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    return _template_fields(stored) == _template_fields(replayed) and _calls(stored, parse_arguments=True) == _calls(
        replayed, parse_arguments=True
    )


def role_content_only(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    return stored.get("role") == replayed.get("role") and message_text(stored.get("content")) == message_text(
        replayed.get("content")
    )


MATCHERS: dict[str, Matcher] = {
    "strict": strict,
    "loose_tool_call": loose_tool_call,
    "role_content_only": role_content_only,
}


def resolve_matcher(spec: str) -> Matcher:
    """A built-in matcher by name or a custom one by import path; ValueError says what was expected."""
    if spec in MATCHERS:
        return MATCHERS[spec]
    try:
        fn = load_function(spec)
    except PluginError as e:
        raise ValueError(
            f"--session-message-matcher {spec!r} is not one of {sorted(MATCHERS)} and does not load "
            f"as fn(stored, replayed) -> bool: {e}"
        ) from None
    if not callable(fn):
        raise ValueError(f"--session-message-matcher {spec!r} is a {type(fn).__name__}, not fn(stored, replayed)")
    return fn


def messages_match(matcher: Matcher, stored: list[dict], replayed: list[dict]) -> bool:
    """Every stored message matches the replayed one at its position (replayed may be longer)."""
    return len(replayed) >= len(stored) and all(matcher(a, b) for a, b in zip(stored, replayed, strict=False))
