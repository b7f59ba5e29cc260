"""Prompt sources: where the rollout loop gets its groups of prompt samples.

`JsonlDataSource` reads `--prompt-data` (JSONL, or parquet: `prompt_files.py`) once, validates every row (a malformed row, non-UTF-8
bytes included, stops the run with `file:line` and what is wrong, or is skipped and counted with
`--skip-bad-rows`), drops prompts longer than its `PromptLimit` (skipped and counted with one
warning naming the longest, as Miles' `--rollout-max-prompt-len` filters; refused with
`--refuse-long-prompts`; a row with more characters than the limit times the vocabulary's longest
token is judged without tokenising), then serves prompts epoch by epoch, reshuffled per epoch with
`rollout_seed + epoch`. Every prompt becomes a group of `n_samples_per_prompt` Samples sharing `group_index`. Groups handed back with
`add_samples` are served first. `state_dict()` holds the epoch, the offset inside it, the id
counters and the handed-back groups, so a resumed run continues at the exact prompt. What a row
must hold, and the errors and limits that judge it, are `prompt_rows.py`'s.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from miles.config import DataConfig
from miles.rollout.prompt_files import PromptFileError, is_parquet, iter_prompt_rows
from miles.rollout.prompt_rows import (
    DataError,
    DataRowError,
    PromptLimit,
    PromptRow,
    PromptTooLong,
    decode_line,
    encode_texts,
    max_chars_per_token,
    parse_row,
    prompt_chars,
    render_text,
    row_from_dict,
)
from miles.rollout.sample import Sample
from miles.utils.misc import load_function, missing_file_line

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


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
