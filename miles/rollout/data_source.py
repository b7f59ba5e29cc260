"""Prompt sources: where the rollout loop gets its groups of prompt samples.

`JsonlDataSource` reads `--prompt-data` (JSONL, or parquet: `prompt_files.py`) once, validates every row (a malformed row, non-UTF-8
bytes included, stops the run with `file:line` and what is wrong, or is skipped and counted with
`--skip-bad-rows`), drops prompts longer than its `PromptLimit` (skipped and counted with one
warning naming the longest, as Miles' `--rollout-max-prompt-len` filters; refused with
`--refuse-long-prompts`; a row with more characters than the limit times the vocabulary's longest
token is judged without tokenising), then serves prompts epoch by epoch, reshuffled per epoch with
`rollout_seed + epoch`. Every prompt becomes a group of `n_samples_per_prompt` Samples sharing `group_index`. Groups handed back with
`add_samples` are served first. `state_dict()` holds the epoch, the offset inside it, the id
counters and the handed-back groups, so a resumed run continues at the exact prompt.
"""

from __future__ import annotations

import copy
import json
import logging
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from miles.config import DataConfig
from miles.rollout.prompt_files import PromptFileError, is_parquet, iter_prompt_rows
from miles.rollout.sample import Sample
from miles.utils.misc import load_function, missing_file_line

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


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


def _longer(a: PromptTooLong, b: PromptTooLong) -> bool:
    """Prompts judged by characters are past the character cap, so longer than any counted in tokens."""
    return (a.unit == "characters", a.length) > (b.unit == "characters", b.length)


class DataSource(ABC):
    """What the rollout loop draws prompt groups from."""

    @abstractmethod
    def get_samples(self, num_groups: int) -> list[list[Sample]]: ...

    @abstractmethod
    def add_samples(self, groups: list[list[Sample]]) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} does not know its number of prompts")


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


ENCODE_BATCH_ROWS = 4096  # prompts tokenised per call while a file is read


# ---- the JSONL source ---------------------------------------------------------------------


class JsonlDataSource(DataSource):
    def __init__(
        self,
        data: DataConfig,
        *,
        n_samples_per_prompt: int,
        tokenizer: Any = None,
        path: str | None = None,
        prompt_limit: PromptLimit | None = None,
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt={n_samples_per_prompt} must be >= 1")
        self.data = data
        self.n_samples_per_prompt = n_samples_per_prompt
        self.path = path or data.prompt_data
        if not self.path:
            raise DataError("no prompt data: set --prompt-data to a JSONL or parquet file")
        if data.apply_chat_template and tokenizer is None:
            raise ValueError("--apply-chat-template needs a tokenizer (from --hf-checkpoint)")
        if prompt_limit is None and data.rollout_max_prompt_len is not None:
            prompt_limit = PromptLimit(data.rollout_max_prompt_len)
        if prompt_limit is not None and tokenizer is None:
            logger.warning(
                "the %d-token prompt limit (%s) is ignored: no tokenizer to count prompt tokens",
                prompt_limit.max_tokens,
                prompt_limit.source,
            )
            prompt_limit = None
        self.prompt_limit = prompt_limit
        self._max_prompt_chars = prompt_limit.max_tokens * max_chars_per_token(tokenizer) if prompt_limit else None
        self.bad_rows = 0
        self.long_prompts_dropped = 0
        self._longest: tuple[PromptTooLong, int] | None = None  # the longest dropped prompt and its line
        self.rows = self._load(Path(self.path), tokenizer)
        self.epoch = 0
        self.offset = 0  # position inside this epoch's order
        self.next_group_index = 0
        self.next_sample_index = 0
        self._buffer: deque[list[Sample]] = deque()
        self._order = self._epoch_order(0)

    def _load(self, path: Path, tokenizer: Any) -> list[PromptRow]:
        if not path.is_file():
            raise DataError(missing_file_line("prompt data", path))
        rows: list[PromptRow] = []
        pending: list[tuple[int, PromptRow]] = []  # read and rendered, tokenised a batch at a time
        try:
            for line_no, raw in iter_prompt_rows(path):
                try:
                    pending.append((line_no, self._read_row(raw, tokenizer)))
                except (PromptTooLong, ValueError) as e:
                    rows += self._tokenize(path, pending, tokenizer)  # earlier rows are judged first
                    pending = []
                    if isinstance(e, PromptTooLong):
                        self._drop_long(path, line_no, e)
                    else:
                        self._bad_row(path, line_no, e)
                if len(pending) >= ENCODE_BATCH_ROWS:
                    rows += self._tokenize(path, pending, tokenizer)
                    pending = []
        except PromptFileError as e:
            raise DataError(f"prompt data {str(path)!r} {e}") from None
        rows += self._tokenize(path, pending, tokenizer)
        self._report_skipped(path)
        if not rows:
            raise DataError(
                f"prompt data {str(path)!r} has no usable rows ({self.bad_rows} malformed, "
                f"{self.long_prompts_dropped} too long)"
            )
        logger.info("loaded %d prompts from %s", len(rows), path)
        return rows

    def _read_row(self, raw: bytes | dict[str, Any], tokenizer: Any) -> PromptRow:
        """Decode, validate, check the length in characters, render the chat template; ValueError for a
        malformed row, PromptTooLong. `raw` is a JSONL line's bytes or a parquet row's dict."""
        row = parse_row(decode_line(raw), self.data) if isinstance(raw, bytes) else row_from_dict(raw, self.data)
        if self._max_prompt_chars is not None:  # far too long to fit: not worth tokenising
            chars = prompt_chars(row.prompt)
            if chars > self._max_prompt_chars:
                raise PromptTooLong(chars, "characters")
        render_text(row, self.data, tokenizer)
        return row

    def _tokenize(self, path: Path, pending: list[tuple[int, PromptRow]], tokenizer: Any) -> list[PromptRow]:
        """Tokenise rendered rows in one batch; the rows that fit the prompt limit, the others dropped."""
        if tokenizer is None:
            return [row for _, row in pending]
        text_rows = [(line_no, row) for line_no, row in pending if isinstance(row.prompt, str)]
        ids = encode_texts(tokenizer, [row.prompt for _, row in text_rows], not self.data.apply_chat_template)
        for (_, row), tokens in zip(text_rows, ids, strict=True):
            row.tokens = tokens
        limit = self.prompt_limit
        kept = []
        for line_no, row in pending:
            if limit is not None and len(row.tokens) > limit.max_tokens:
                self._drop_long(path, line_no, PromptTooLong(len(row.tokens), "tokens"))
            else:
                kept.append(row)
        return kept

    def _bad_row(self, path: Path, line_no: int, error: ValueError) -> None:
        message = f"{path}:{line_no}: {error}"
        if not self.data.skip_bad_rows:
            raise DataRowError(
                f"{message}; fix the file or pass --skip-bad-rows to skip and count such rows"
            ) from None
        self.bad_rows += 1
        logger.warning("skipping malformed row %s", message)

    def _drop_long(self, path: Path, line_no: int, error: PromptTooLong) -> None:
        limit = self.prompt_limit
        assert limit is not None
        if self.data.refuse_long_prompts:
            raise DataRowError(
                f"{path}:{line_no}: the prompt has {error} (more than the {limit.max_tokens}-token limit of "
                f"{limit.source}); shorten or drop the row, or drop --refuse-long-prompts to skip and count such rows"
            )
        self.long_prompts_dropped += 1
        if self._longest is None or _longer(error, self._longest[0]):
            self._longest = (error, line_no)

    def _report_skipped(self, path: Path) -> None:
        if self.bad_rows:
            logger.warning("%s: skipped %d malformed rows (--skip-bad-rows)", path, self.bad_rows)
        if self.long_prompts_dropped:
            assert self.prompt_limit is not None and self._longest is not None
            longest, line_no = self._longest
            logger.warning(
                "%s: skipped %d prompts longer than the %d-token limit of %s; the longest has %s (%s %d). "
                "Pass --refuse-long-prompts to stop instead",
                path,
                self.long_prompts_dropped,
                self.prompt_limit.max_tokens,
                self.prompt_limit.source,
                longest,
                "row" if is_parquet(path) else "line",
                line_no,
            )

    def __len__(self) -> int:
        return len(self.rows)

    def rewind(self) -> None:
        """Back to the first prompt of epoch 0 with fresh ids (an eval set is drawn whole each time)."""
        self.epoch = self.offset = self.next_group_index = self.next_sample_index = 0
        self._buffer.clear()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.data.rollout_shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng(self.data.rollout_seed + epoch).permutation(len(self.rows))

    def _next_row(self) -> PromptRow:
        if self.offset >= len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        row = self.rows[int(self._order[self.offset])]
        self.offset += 1
        return row

    def _make_group(self, row: PromptRow) -> list[Sample]:
        group_index = self.next_group_index
        self.next_group_index += 1
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(
                Sample(
                    prompt=copy.deepcopy(row.prompt),
                    tokens=list(row.tokens),
                    label=row.label,
                    metadata=copy.deepcopy(row.metadata),
                    group_index=group_index,
                    index=self.next_sample_index,
                )
            )
            self.next_sample_index += 1
        return group

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: handed-back groups first (FIFO), then fresh prompts."""
        groups: list[list[Sample]] = []
        while self._buffer and len(groups) < num_groups:
            groups.append(self._buffer.popleft())
        while len(groups) < num_groups:
            groups.append(self._make_group(self._next_row()))
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Hand groups back (aborted or recycled); they are served before fresh prompts."""
        for group in groups:
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"group {group[0].group_index if group else None} has {len(group)} samples; "
                    f"handed-back groups must keep n_samples_per_prompt={self.n_samples_per_prompt}"
                )
            self._buffer.append(group)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (no tensors, no pickle)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "num_prompts": len(self.rows),
            "rollout_shuffle": self.data.rollout_shuffle,
            "rollout_seed": self.data.rollout_seed,
            "buffer": [[s.to_dict() for s in group] for group in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts") != len(self.rows):
            raise ValueError(
                f"data source state is for {state.get('num_prompts')} prompts but {self.path!r} has {len(self.rows)}; "
                "resume with the same --prompt-data (and --rollout-max-prompt-len / --skip-bad-rows)"
            )
        for key in ("rollout_shuffle", "rollout_seed"):
            if state.get(key) != getattr(self.data, key):
                logger.warning(
                    "resuming with --%s=%s but the state used %s",
                    key.replace("_", "-"),
                    getattr(self.data, key),
                    state.get(key),
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.next_group_index = int(state["next_group_index"])
        self.next_sample_index = int(state["next_sample_index"])
        self._order = self._epoch_order(self.epoch)
        self._buffer = deque([Sample.from_dict(d) for d in group] for group in state.get("buffer", []))


def load_data_source(
    data: DataConfig, *, n_samples_per_prompt: int, tokenizer: Any = None, prompt_limit: PromptLimit | None = None
) -> DataSource:
    """The JSONL source, or the class named by `--data-source-path` (same constructor keywords).

    `prompt_limit` (default: `--rollout-max-prompt-len`) applies to the JSONL source; a custom source
    checks its own prompts.
    """
    if not data.data_source_path:
        return JsonlDataSource(
            data, n_samples_per_prompt=n_samples_per_prompt, tokenizer=tokenizer, prompt_limit=prompt_limit
        )
    cls = load_function(data.data_source_path)
    source = cls(data, n_samples_per_prompt=n_samples_per_prompt, tokenizer=tokenizer)
    missing = [m for m in ("get_samples", "add_samples", "state_dict", "load_state_dict") if not hasattr(source, m)]
    if missing:
        raise TypeError(
            f"--data-source-path {data.data_source_path!r} built {type(source).__name__}, which lacks {missing}"
        )
    return source
