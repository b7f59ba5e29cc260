"""Prompt files row by row: JSONL lines or parquet rows, each with its 1-based number.

A file is parquet when it starts with parquet's magic bytes (`PAR1`), whatever its name; anything
else is read as JSONL. A JSONL row comes as the raw bytes of its line (decoded and parsed by the
caller, so a bad byte or bad JSON is reported with its line); a parquet row comes as a dict of
plain Python values (lists of structs become lists of dicts, as chat messages need). Reading
parquet needs pyarrow, an optional dependency: `pip install 'miles[parquet]'`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARQUET_MAGIC = b"PAR1"
_PARQUET_BATCH_ROWS = 1024  # rows converted to Python at a time: a large file is not held twice


class PromptFileError(ValueError):
    """The file cannot be read at all (not a bad row); the message says why and how to fix it."""


def is_parquet(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC


def iter_jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for every non-blank line; a UTF-8 byte-order mark is dropped."""
    with path.open("rb") as f:  # bytes: a bad byte is reported with its line, not for the whole file
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if raw.strip():  # blank lines (e.g. a trailing newline) are not rows
                yield line_no, raw


def _parquet_module() -> Any:
    try:
        return importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise PromptFileError(
            "is a parquet file, and reading parquet needs pyarrow: pip install 'miles[parquet]' (or pyarrow)"
        ) from None


def iter_parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, row as a dict) for every row of a parquet file."""
    pq = _parquet_module()
    try:
        parquet_file = pq.ParquetFile(path)
        row_no = 0
        for batch in parquet_file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                row_no += 1
                yield row_no, row
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid and ArrowIOError derive from these
        raise PromptFileError(f"is not a readable parquet file ({type(e).__name__}: {e})") from None


def iter_prompt_rows(path: Path) -> Iterator[tuple[int, bytes | dict[str, Any]]]:
    """Every row of a JSONL or parquet prompt file with its 1-based line or row number."""
    return iter_parquet_rows(path) if is_parquet(path) else iter_jsonl_lines(path)
