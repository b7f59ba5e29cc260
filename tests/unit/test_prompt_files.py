"""Parquet prompt data: the same rows, checks and errors as JSONL; a clear line without pyarrow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles.config import DataConfig
from miles.rollout import prompt_files
from miles.rollout.data_source import JsonlDataSource
from miles.rollout.prompt_rows import DataError, DataRowError

ROWS = [
    {"input": "what is 1+1?", "label": 2, "metadata": {"level": 1}},
    {"input": [{"role": "user", "content": "say hi"}], "label": "hi", "metadata": {"level": 2}},
    {"input": "what is 2+2?", "label": 4, "metadata": {"level": 3}},
]


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # A parquet column has one type: text prompts and chat-message prompts go in separate files.
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _source(path: Path, **data_kw) -> JsonlDataSource:
    data = DataConfig(prompt_data=str(path), label_key="label", rollout_shuffle=False, **data_kw)
    return JsonlDataSource(data, n_samples_per_prompt=2)


def test_parquet_rows_become_the_same_samples_as_jsonl(tmp_path: Path) -> None:
    text_rows = [ROWS[0], ROWS[2]]
    source = _source(_write_parquet(tmp_path / "p.parquet", text_rows))
    groups = source.get_samples(2)
    assert [[s.prompt for s in g] for g in groups] == [["what is 1+1?"] * 2, ["what is 2+2?"] * 2]
    assert [g[0].label for g in groups] == ["2", "4"]  # integer labels become text, as from JSONL
    assert [g[0].metadata for g in groups] == [{"level": 1}, {"level": 3}]

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in text_rows))
    from_jsonl = _source(jsonl).get_samples(2)
    assert [[s.to_dict() for s in g] for g in groups] == [[s.to_dict() for s in g] for g in from_jsonl]


def test_parquet_chat_messages_are_lists_of_dicts(tmp_path: Path) -> None:
    source = _source(_write_parquet(tmp_path / "chat.parquet", [ROWS[1]]))
    (sample, _) = source.get_samples(1)[0]
    assert sample.prompt == [{"role": "user", "content": "say hi"}]
    assert sample.label == "hi"


def test_parquet_is_recognised_by_content_not_name(tmp_path: Path) -> None:
    source = _source(_write_parquet(tmp_path / "prompts.data", [ROWS[0]]))
    assert len(source) == 1


def test_bad_parquet_row_reports_file_and_row(tmp_path: Path) -> None:
    rows = [{"input": "q0", "label": "0"}, {"input": None, "label": "1"}, {"input": "q2", "label": "2"}]
    path = _write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataRowError) as info:
        _source(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert "must be text or a list of messages" in str(info.value)
    assert len(_source(path, skip_bad_rows=True)) == 2


def test_eval_data_reads_parquet(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "eval.parquet", [ROWS[0], ROWS[2]])
    data = DataConfig(prompt_data=None, label_key="label", rollout_shuffle=False)
    source = JsonlDataSource(data, n_samples_per_prompt=1, path=str(path))
    assert [g[0].prompt for g in source.get_samples(2)] == ["what is 1+1?", "what is 2+2?"]


def test_corrupt_parquet_is_one_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(prompt_files.PARQUET_MAGIC + b"not really parquet")
    with pytest.raises(DataError, match="is not a readable parquet file") as info:
        _source(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # importing it now raises ImportError
    path = tmp_path / "p.parquet"
    path.write_bytes(prompt_files.PARQUET_MAGIC + b"\x00" * 16)
    with pytest.raises(DataError) as info:
        _source(path)
    message = str(info.value)
    assert str(path) in message and "pip install 'miles[parquet]'" in message and "\n" not in message
