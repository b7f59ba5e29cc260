"""Token-in-token-out tokenisation: the server, not the harness, turns messages into token ids.

The first turn of a trajectory renders the family's chat template over the messages and
tokenises it. A later turn starts from the token ids stored at the checkpoint it extends (the
prompt and the engine's own output, never re-tokenised) and tokenises only the appended text:
what the template writes after the stored assistant turn's end-of-turn token, then the new
messages and the generation prompt. That is exact when the template is append-only (rendering a
longer conversation only appends text), which `check_append_only` verifies on CPU for a family.

When the stored turn ended without its end-of-turn token (a stop string matched first), the
suffix closes the turn itself; those tokens, like every appended token, get loss mask 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles.agent.families import ModelFamily

MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


class NotAppendOnly(ValueError):
    """The template re-rendered earlier text differently once the conversation grew."""


def message_text(content: Any) -> str:
    """OpenAI content (None, a string, or a list of parts) as the text a template renders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    raise ValueError(f"message content must be a string, a list of parts or null, got {type(content).__name__}")


def normalize_message(message: Any) -> dict[str, Any]:
    """The fields a chat template reads, in the shapes templates expect (content as text)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"each message must be an object with a string 'role', got {str(message)[:80]}")
    out: dict[str, Any] = {"role": message["role"], "content": message_text(message.get("content"))}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message_text(message["reasoning_content"])
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalize_call(c) for c in calls]
        if not out["content"]:
            out["content"] = None
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def _normalize_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool call needs function.name, got {str(call)[:80]}")
    args = fn.get("arguments")
    args = "{}" if args in (None, "") else args
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


@dataclass(slots=True)
class TitoTokenizer:
    """A family's template, end-of-turn token and tool-call parser over one tokenizer."""

    family: ModelFamily
    tokenizer: Any
    end_of_turn: str = ""
    end_of_turn_id: int = -1

    def __post_init__(self) -> None:
        self.end_of_turn = self.family.end_of_turn or self.tokenizer.eos_token
        ids = self.encode(self.end_of_turn or "")
        if len(ids) != 1:
            raise ValueError(
                f"family {self.family.name!r}: end of turn {self.end_of_turn!r} is {len(ids)} tokens for "
                "this tokenizer; it must be one token (the model's stop token)"
            )
        self.end_of_turn_id = ids[0]

    # ---- messages -> tokens -----------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.family.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A first turn: the whole conversation rendered with the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def suffix_ids(
        self, messages: list[dict], stored: int, tools: list[dict] | None, *, closed_turn: bool
    ) -> list[int]:
        """Tokens to append to a checkpoint holding `messages[:stored]` (its last one the model's turn)."""
        prefix = self.render(messages[:stored], tools, add_generation_prompt=False)
        full = self.render(messages, tools, add_generation_prompt=True)
        if not full.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), len(full))
            raise NotAppendOnly(
                f"family {self.family.name!r}: the template renders the first {stored} messages differently once "
                f"more follow (from character {at}: {prefix[at : at + 40]!r} became {full[at : at + 40]!r}); "
                "pick a family whose template is append-only (--tito-model) or register one"
            )
        cut = prefix.rfind(self.end_of_turn)
        if cut < 0:
            raise NotAppendOnly(
                f"family {self.family.name!r}: the template did not end the assistant turn with "
                f"{self.end_of_turn!r}; register the family's end_of_turn"
            )
        glue = prefix[cut + len(self.end_of_turn) :]
        head = glue if closed_turn else self.end_of_turn + glue
        return self.encode(head + full[len(prefix) :])

    # ---- tokens -> message ------------------------------------------------------------------
    def parse_reply(self, output_ids: list[int]) -> dict[str, Any]:
        """The assistant message of one turn's output (the end-of-turn token is not part of the text)."""
        ids = output_ids[:-1] if output_ids and output_ids[-1] == self.end_of_turn_id else output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = self.family.parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message


# ---------------------------------------------------------------- the CPU append-only check

_CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _call(call_id: str, expression: str) -> dict[str, Any]:
    args = json.dumps({"expression": expression})
    return {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": args}}


# Conversations the check replays turn by turn: system prompts, tool calls (one and several per
# turn, with and without text), tool results, user follow-ups, plain answers.
CHECK_CONVERSATIONS: tuple[tuple[list[dict], list[dict] | None], ...] = (
    (
        [
            {"role": "user", "content": "What is 12 * 7 + 5?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "12 * 7")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "84"},
            {"role": "assistant", "content": "Then I add 5.", "tool_calls": [_call("call_2", "84 + 5")]},
            {"role": "tool", "tool_call_id": "call_2", "content": "89"},
            {"role": "assistant", "content": "Answer: 89"},
        ],
        [_CALC_TOOL],
    ),
    (
        [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Add 2 and 3, and multiply 4 by 5."},
            {"role": "assistant", "content": None, "tool_calls": [_call("a", "2 + 3"), _call("b", "4 * 5")]},
            {"role": "tool", "tool_call_id": "a", "content": "5"},
            {"role": "tool", "tool_call_id": "b", "content": "20"},
            {"role": "assistant", "content": "5 and 20."},
            {"role": "user", "content": "And their sum?"},
            {"role": "assistant", "content": "25"},
        ],
        [_CALC_TOOL],
    ),
    (
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hello?"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Bye."},
            {"role": "assistant", "content": ""},
        ],
        None,
    ),
)


def check_append_only(
    tito: TitoTokenizer, conversations: tuple[tuple[list[dict], list[dict] | None], ...] = CHECK_CONVERSATIONS
) -> list[str]:
    """Replay each conversation as the session server would; one line per conversation that breaks.

    The model's output of a turn is taken as the canonical tokens of its rendered turn up to and
    including the end-of-turn token; every later prompt is built from the stored ids plus
    `suffix_ids` and compared with the canonical tokenisation of the whole conversation. Empty:
    the family is append-only for this tokenizer on these conversations.
    """
    problems = []
    for n, (conversation, tools) in enumerate(conversations):
        try:
            problem = _replay(tito, [normalize_message(m) for m in conversation], tools)
        except Exception as e:  # noqa: BLE001 - a template that cannot render tools or tool calls
            problem = f"the template fails: {type(e).__name__}: {e}"
        if problem is not None:
            problems.append(f"conversation {n}: {problem}")
    return problems


def _replay(tito: TitoTokenizer, messages: list[dict], tools: list[dict] | None) -> str | None:
    stored: list[int] | None = None
    last_assistant = -1
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            built = (
                tito.prompt_ids(messages[:k], tools)
                if stored is None
                else stored + tito.suffix_ids(messages[:k], last_assistant + 1, tools, closed_turn=True)
            )
        except NotAppendOnly as e:
            return f"turn at message {k}: {e}"
        canonical = tito.prompt_ids(messages[:k], tools)
        if built != canonical:
            return _first_difference(tito, k, built, canonical)
        whole = tito.encode(tito.render(messages[: k + 1], tools, add_generation_prompt=False))
        end = _end_of_turn_at(whole, len(built), tito.end_of_turn_id)
        if whole[: len(built)] != built or end is None:
            return (
                f"message {k}: the rendered assistant turn does not extend its prompt's tokens and end with "
                f"{tito.end_of_turn!r}"
            )
        stored, last_assistant = whole[: end + 1], k
    return None


def _end_of_turn_at(ids: list[int], start: int, end_id: int) -> int | None:
    return next((i for i in range(start, len(ids)) if ids[i] == end_id), None)


def _first_difference(tito: TitoTokenizer, k: int, built: list[int], canonical: list[int]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(built, canonical, strict=False)) if a != b), min(len(built), len(canonical))
    )
    return (
        f"turn at message {k}: incremental ids differ from the full render at token {at} "
        f"({tito.tokenizer.decode(built[at : at + 8])!r} vs {tito.tokenizer.decode(canonical[at : at + 8])!r})"
    )
