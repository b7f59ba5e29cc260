"""Prompt rows: what one row of `--prompt-data` must hold, and how it becomes a `PromptRow`.

`parse_row` (a JSONL line) and `row_from_dict` (a decoded row, JSONL or parquet) validate a row and
raise ValueError saying what is wrong and how to fix it; `decode_line` refuses bytes that are not
UTF-8, naming the column. `render_text` applies the chat template in place and `encode_texts`
tokenises rendered prompts a batch at a time. `PromptLimit` is the most tokens a prompt may have;
`prompt_chars` and `max_chars_per_token` judge a row by characters before tokenising it, and
`PromptTooLong` carries the verdict. `DataError` (the data cannot be used) and `DataRowError` (one row
cannot, `file:line` first) are what the data sources raise to stop a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from miles.config import DataConfig


class DataError(ValueError):
    """The prompt data cannot be used; the message names the file and the fix."""


class DataRowError(DataError):
    """A prompt row that cannot be used; the message starts with `file:line`."""


# A prompt cannot pack more characters into one token than the vocabulary's longest token; this floor
# keeps the bound generous for vocabularies that do not list their tokens.
MIN_CHARS_PER_TOKEN_BOUND = 32


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The most tokens a prompt may have, and where that number comes from (named in messages)."""

    max_tokens: int
    source: str = "--rollout-max-prompt-len"


class PromptTooLong(Exception):
    """A row whose prompt exceeds the limit: `length` tokens, or characters when not tokenised."""

    def __init__(self, length: int, unit: str) -> None:
        super().__init__(f"{length} {unit}")
        self.length, self.unit = length, unit


@dataclass(slots=True)
class PromptRow:
    """One validated row: what every sample of its group starts from."""

    prompt: str | list[dict[str, Any]]
    label: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


# ---- row parsing --------------------------------------------------------------------------


def _check_messages(value: list, key: str) -> None:
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{key!r}[{i}] must be a message dict with 'role' and 'content', got {msg!r:.120}")
        if not isinstance(msg["role"], str):
            raise ValueError(f"{key!r}[{i}].role is {msg['role']!r}; give the role as text (user, assistant, ...)")
        if msg["content"] is None and not msg.get("tool_calls"):
            raise ValueError(f"{key!r}[{i}].content is null; give the message's text ('' for none)")


def _label_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)  # structured labels travel as JSON text


def _metadata_of(row: dict[str, Any], data: DataConfig) -> dict[str, Any]:
    metadata = row.get(data.metadata_key, {})
    if isinstance(metadata, str):  # some datasets store the metadata column as JSON text
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as e:
            raise ValueError(f"{data.metadata_key!r} is a string but not JSON ({e.msg})") from e
    if metadata is None:
        raise ValueError(f"{data.metadata_key!r} is null; give an object, or leave the key out")
    if not isinstance(metadata, dict):
        raise ValueError(f"{data.metadata_key!r} must be an object, got {type(metadata).__name__}")
    metadata = dict(metadata)
    if data.tool_key in row and row[data.tool_key] is not None:
        tools = row[data.tool_key]
        if isinstance(tools, str):
            tools = json.loads(tools)
        if not isinstance(tools, list):
            raise ValueError(f"{data.tool_key!r} must be a list of tool specs, got {type(tools).__name__}")
        metadata["tools"] = tools
    return metadata


def decode_line(raw: bytes) -> str:
    """One line of the file as text; a byte that is not UTF-8 is a malformed row, with its column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None


def prompt_chars(prompt: str | list[dict[str, Any]]) -> int:
    """Characters of the prompt's text before any chat template (which only adds tokens); content
    that is not text (multimodal parts) is not counted."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if isinstance(m["content"], str))


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound of the characters one token covers: the longest entry of the vocabulary."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        longest = 0
    return max(longest, MIN_CHARS_PER_TOKEN_BOUND)


def parse_row(line: str, data: DataConfig) -> PromptRow:
    """Validate one JSONL line; ValueError says what is wrong and how to fix it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    return row_from_dict(row, data)


def row_from_dict(row: dict[str, Any], data: DataConfig) -> PromptRow:
    """Validate one decoded row (a JSONL object or a parquet row); ValueError says what is wrong."""
    if data.input_key not in row:
        raise ValueError(f"missing prompt key {data.input_key!r} (keys: {sorted(row)}); set --input-key")
    prompt = row[data.input_key]
    if isinstance(prompt, list):
        _check_messages(prompt, data.input_key)
    elif not isinstance(prompt, str):
        raise ValueError(f"{data.input_key!r} must be text or a list of messages, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError(f"{data.input_key!r} is empty")
    label = None
    if data.label_key:
        if data.label_key not in row:
            raise ValueError(f"missing label key {data.label_key!r} (keys: {sorted(row)}); set --label-key")
        if row[data.label_key] is None:
            raise ValueError(f"label {data.label_key!r} is null; give every row a label, or drop --label-key")
        label = _label_text(row[data.label_key])
    return PromptRow(prompt=prompt, label=label, metadata=_metadata_of(row, data))


def render_text(row: PromptRow, data: DataConfig, tokenizer: Any) -> None:
    """Apply the chat template in place, when asked (ValueError where it rejects the messages)."""
    if not data.apply_chat_template:
        return
    if tokenizer is None:
        raise ValueError("--apply-chat-template needs a tokenizer (from --hf-checkpoint)")
    messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else row.prompt
    try:
        row.prompt = tokenizer.apply_chat_template(
            messages, tools=row.metadata.get("tools"), tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # noqa: BLE001 - templates raise jinja errors for bad roles/content
        raise ValueError(f"the chat template rejected the messages: {type(e).__name__}: {e}") from e


def encode_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of `texts`, in one call where the tokenizer takes a batch (a Rust tokenizer encodes it on
    all cores). A rendered chat template already holds its special tokens (add_special_tokens False); plain
    text gets the tokenizer's defaults (BOS), as an engine given the text would add them."""
    if not texts:
        return []
    batch = getattr(tokenizer, "encode_batch_ids", None)  # miles' file tokenizer
    if callable(batch):
        return batch(texts, add_special_tokens=add_special_tokens)
    if getattr(tokenizer, "is_fast", False) is True:  # transformers' fast tokenizers take a list
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
    return [list(tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"]) for t in texts]
