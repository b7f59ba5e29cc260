"""JSONL prompt source: row validation with file:line, groups, epochs, shuffling, resume, plug-ins."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from miles.config import DataConfig
from miles.rollout.data_source import DataSource, JsonlDataSource, load_data_source
from miles.rollout.prompt_rows import DataRowError, PromptLimit
from miles.rollout.sample import Sample


def _write(tmp_path: Path, rows: list, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _rows(n: int) -> list[dict]:
    return [{"input": f"q{i}", "label": str(i), "metadata": {"k": i}} for i in range(n)]


def _source(path: Path, n: int = 1, **data_kw) -> JsonlDataSource:
    data = DataConfig(prompt_data=str(path), label_key="label", **data_kw)
    return JsonlDataSource(data, n_samples_per_prompt=n)


def _prompts(groups: list[list[Sample]]) -> list[str]:
    return [g[0].prompt for g in groups]


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"input": "q", "label": ', "not valid JSON"),
        ('["q", "1"]', "must be a JSON object"),
        ({"prompt": "q", "label": "1"}, "missing prompt key 'input'"),
        ({"input": "q"}, "missing label key 'label'"),
        ({"input": 5, "label": "1"}, "must be text or a list of messages"),
        ({"input": [{"content": "hi"}], "label": "1"}, "'role' and 'content'"),
        ({"input": "q", "label": "1", "metadata": [1]}, "'metadata' must be an object"),
        ({"input": "q", "label": "1", "tools": {"name": "f"}}, "'tools' must be a list"),
    ],
)
def test_malformed_row_reports_file_and_line(tmp_path: Path, bad_row, message: str) -> None:
    rows = _rows(3)
    rows.insert(2, bad_row)  # line 3
    path = _write(tmp_path, rows)
    with pytest.raises(DataRowError) as info:
        _source(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)
    assert "--skip-bad-rows" in str(info.value)


def test_skip_bad_rows_counts_and_keeps_the_rest(tmp_path: Path) -> None:
    rows = _rows(4)
    rows[1] = "{oops"
    rows.append({"label": "x"})
    path = _write(tmp_path, rows)
    source = _source(path, skip_bad_rows=True)
    assert source.bad_rows == 2
    assert len(source) == 3
    assert _prompts(source.get_samples(3)) == ["q0", "q2", "q3"]


def test_all_rows_bad_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, ["{", "{"])
    with pytest.raises(ValueError, match="no usable rows"):
        _source(path, skip_bad_rows=True)


def test_groups_share_group_index_and_have_unique_indices(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(5))
    source = _source(path, n=4)
    groups = source.get_samples(3)
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    for g in groups:
        assert len({s.group_index for s in g}) == 1
        assert len({s.prompt for s in g}) == 1 and len({s.label for s in g}) == 1
    assert len({g[0].group_index for g in groups}) == 3
    indices = [s.index for g in groups for s in g]
    assert indices == list(range(12))
    groups[0][0].metadata["k"] = "changed"  # copies are independent
    assert groups[0][1].metadata["k"] == 0


def test_labels_metadata_and_tools(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "calc"}}]
    path = _write(tmp_path, [{"input": "q", "label": 7, "metadata": '{"rm_type": "gsm8k"}', "tools": tools}])
    sample = _source(path).get_samples(1)[0][0]
    assert sample.label == "7"
    assert sample.metadata == {"rm_type": "gsm8k", "tools": tools}


def test_epochs_wrap_and_reshuffle_deterministically(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(6))
    source = _source(path, rollout_shuffle=True, rollout_seed=3)
    first, second = _prompts(source.get_samples(6)), _prompts(source.get_samples(6))
    assert sorted(first) == sorted(second) == [f"q{i}" for i in range(6)]  # every prompt once per epoch
    assert source.epoch == 1
    again = _source(path, rollout_shuffle=True, rollout_seed=3)
    assert _prompts(again.get_samples(12)) == first + second
    other_seed = _source(path, rollout_shuffle=True, rollout_seed=4)
    assert _prompts(other_seed.get_samples(6)) != first or _prompts(other_seed.get_samples(6)) != second


def test_no_shuffle_keeps_file_order_across_epochs(tmp_path: Path) -> None:
    source = _source(_write(tmp_path, _rows(3)))
    assert _prompts(source.get_samples(7)) == ["q0", "q1", "q2", "q0", "q1", "q2", "q0"]


def test_resume_continues_at_the_exact_prompt_and_epoch(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(5))
    reference = _source(path, n=2, rollout_shuffle=True)
    expected = reference.get_samples(13)

    first = _source(path, n=2, rollout_shuffle=True)
    head = first.get_samples(7)  # ends inside epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    assert state["epoch"] == 1 and state["offset"] == 2

    resumed = _source(path, n=2, rollout_shuffle=True)
    resumed.load_state_dict(state)
    tail = resumed.get_samples(6)
    got = head + tail
    assert _prompts(got) == _prompts(expected)
    assert [s.index for g in got for s in g] == [s.index for g in expected for s in g]
    assert [g[0].group_index for g in got] == [g[0].group_index for g in expected]
    assert resumed.epoch == reference.epoch == 2


def test_handed_back_groups_come_first_and_survive_resume(tmp_path: Path) -> None:
    path = _write(tmp_path, _rows(4))
    source = _source(path, n=2)
    g0, g1 = source.get_samples(2)
    source.add_samples([g1, g0])
    state = source.state_dict()
    resumed = _source(path, n=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for s in (source, resumed):
        out = s.get_samples(3)
        assert _prompts(out) == ["q1", "q0", "q2"]
        assert [x.index for x in out[0]] == [2, 3]  # a recycled group keeps its identity


def test_add_samples_rejects_wrong_group_size(tmp_path: Path) -> None:
    source = _source(_write(tmp_path, _rows(2)), n=2)
    group = source.get_samples(1)[0]
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        source.add_samples([group[:1]])


def test_state_for_other_data_is_rejected(tmp_path: Path) -> None:
    state = _source(_write(tmp_path, _rows(3), "a.jsonl")).state_dict()
    other = _source(_write(tmp_path, _rows(4), "b.jsonl"))
    with pytest.raises(ValueError, match="state is for 3 prompts"):
        other.load_state_dict(state)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>", "user:", "assistant:", "tools:", "hello", "there", "a", "b", "c", "d", "e"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.chat_template = (
        "{% if tools %}tools: {{ tools | length }} {% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return fast


def test_chat_template_and_prompt_length_filter(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    rows = [
        {"input": "hello there", "label": "1"},
        {"input": [{"role": "user", "content": "a b c d e"}], "label": "2", "tools": tools},
    ]
    path = _write(tmp_path, rows)
    data = DataConfig(prompt_data=str(path), label_key="label", apply_chat_template=True)
    source = JsonlDataSource(data, n_samples_per_prompt=1, tokenizer=_tiny_tokenizer())
    first, second = (g[0] for g in source.get_samples(2))
    assert first.prompt == "user: hello there assistant:"
    assert second.prompt == "tools: 1 user: a b c d e assistant:"
    assert len(first.tokens) == 4 and len(second.tokens) == 9
    short = JsonlDataSource(
        replace(data, rollout_max_prompt_len=5), n_samples_per_prompt=1, tokenizer=_tiny_tokenizer()
    )
    assert len(short) == 1 and short.long_prompts_dropped == 1


def test_chat_template_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    data = DataConfig(prompt_data=str(_write(tmp_path, _rows(1))), apply_chat_template=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        JsonlDataSource(data, n_samples_per_prompt=1)


class ListSource(DataSource):
    """A custom source loaded by import path in the test below."""

    def __init__(self, data: DataConfig, *, n_samples_per_prompt: int, tokenizer=None) -> None:
        self.n = n_samples_per_prompt
        self.served = 0

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = [
            [Sample(prompt=f"c{self.served + g}", group_index=self.served + g) for _ in range(self.n)]
            for g in range(num_groups)
        ]
        self.served += num_groups
        return groups

    def add_samples(self, groups) -> None:
        pass

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


def test_load_data_source_honours_custom_path(tmp_path: Path) -> None:
    source = load_data_source(DataConfig(data_source_path=f"{__name__}:ListSource"), n_samples_per_prompt=3)
    assert isinstance(source, ListSource)
    assert [len(g) for g in source.get_samples(2)] == [3, 3]
    default = load_data_source(DataConfig(prompt_data=str(_write(tmp_path, _rows(2)))), n_samples_per_prompt=1)
    assert isinstance(default, JsonlDataSource) and len(default) == 2


# ---- bad bytes, long prompts, huge rows -------------------------------------------------------


def test_non_utf8_byte_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(
        b'{"input": "q0", "label": "0"}\n{"input": "q1", "label": "1"}\n{"in\xffput": "q", "label": "2"}\n'
    )
    with pytest.raises(DataRowError) as info:
        _source(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: not UTF-8 (byte 0xff at column 5)")
    assert "fix the file or pass --skip-bad-rows" in message and "\n" not in message


def test_skip_bad_rows_skips_and_counts_non_utf8_rows(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"input": "q0", "label": "0"}\n{"input": "\xc3(", "label": "1"}\n{"input": "q2", "label": "2"}\n'
    )
    source = _source(path, skip_bad_rows=True)
    assert source.bad_rows == 1
    assert _prompts(source.get_samples(2)) == ["q0", "q2"]  # the byte-order mark of line 1 is not an error


class CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it was asked to tokenise."""

    def __init__(self) -> None:
        self.inner = _tiny_tokenizer()
        self.texts: list[int] = []

    def __call__(self, text: str, **kw):
        self.texts.append(len(text))
        return self.inner(text, **kw)

    def get_vocab(self) -> dict[str, int]:
        return self.inner.get_vocab()


def _long_rows(tmp_path: Path) -> Path:
    rows = _rows(4)
    rows[1] = {"input": " ".join(["a"] * 12), "label": "1"}  # 12 tokens
    rows[3] = {"input": "b " * 2_000_000, "label": "3"}  # 4 MB: far more characters than 8 tokens can hold
    return _write(tmp_path, rows)


def test_too_long_prompts_are_skipped_and_counted_and_huge_rows_not_tokenised(tmp_path: Path, caplog) -> None:
    path = _long_rows(tmp_path)
    tokenizer = CountingTokenizer()
    source = JsonlDataSource(
        DataConfig(prompt_data=str(path), label_key="label"),
        n_samples_per_prompt=1,
        tokenizer=tokenizer,
        prompt_limit=PromptLimit(8, "the engine's context"),
    )
    assert len(source) == 2 and source.long_prompts_dropped == 2
    assert _prompts(source.get_samples(2)) == ["q0", "q2"]
    assert max(tokenizer.texts) < 100  # the 4 MB row was judged by its characters alone
    warning = next(r.getMessage() for r in caplog.records if "longer than" in r.getMessage())
    assert "skipped 2 prompts longer than the 8-token limit of the engine's context" in warning
    assert "the longest has 4000000 characters (line 4)" in warning and "--refuse-long-prompts" in warning


def test_refuse_long_prompts_stops_at_the_first_with_file_and_line(tmp_path: Path) -> None:
    path = _long_rows(tmp_path)
    data = DataConfig(prompt_data=str(path), label_key="label", refuse_long_prompts=True)
    with pytest.raises(DataRowError) as info:
        JsonlDataSource(data, n_samples_per_prompt=1, tokenizer=_tiny_tokenizer(), prompt_limit=PromptLimit(8))
    message = str(info.value)
    assert message.startswith(
        f"{path}:2: the prompt has 12 tokens (more than the 8-token limit of --rollout-max-prompt-len)"
    )
    assert "drop --refuse-long-prompts" in message


def test_rewind_serves_the_same_groups_again(tmp_path: Path) -> None:
    source = _source(_write(tmp_path, _rows(3)), n=2)
    first = source.get_samples(3)
    source.add_samples([first[0]])
    source.rewind()
    again = source.get_samples(3)
    assert _prompts(again) == _prompts(first)
    assert [s.index for g in again for s in g] == [s.index for g in first for s in g] == list(range(6))


@pytest.mark.parametrize("batch_rows", [1, 3, 4096])
def test_prompts_tokenised_in_batches_get_the_tokens_of_one_at_a_time(tmp_path: Path, monkeypatch, batch_rows) -> None:
    """Rows are tokenised a batch at a time (the Rust tokenizer's batch call); every row's tokens, the rows
    kept and the long ones dropped are those of tokenising each prompt on its own."""
    import miles.rollout.data_source as ds
    from miles.utils.tokenizer_file import FileTokenizer

    monkeypatch.setattr(ds, "ENCODE_BATCH_ROWS", batch_rows)
    words = ["hello", "there", "a", "b", "c", "d", "e"]
    rows = [{"input": " ".join(words[(i * 3 + k) % 7] for k in range(1 + i % 9)), "label": str(i)} for i in range(11)]
    rows.insert(5, {"bad": "row"})  # a malformed row between batches, skipped
    path = _write(tmp_path, rows)
    data = DataConfig(prompt_data=str(path), label_key="label", skip_bad_rows=True)
    fast = _tiny_tokenizer()
    file_tok = FileTokenizer.__new__(FileTokenizer)  # the file tokenizer over the same tokenizers object
    file_tok._tok = fast.backend_tokenizer
    for tokenizer in (fast, file_tok, CountingTokenizer()):
        source = JsonlDataSource(data, n_samples_per_prompt=1, tokenizer=tokenizer, prompt_limit=PromptLimit(6))
        kept = [g[0] for g in source.get_samples(len(source))]
        expected = [r for r in rows if "input" in r and len(fast(r["input"])["input_ids"]) <= 6]
        assert [s.prompt for s in kept] == [r["input"] for r in expected]
        assert [s.tokens for s in kept] == [fast(r["input"])["input_ids"] for r in expected]
        assert source.long_prompts_dropped == 11 - len(expected) and source.bad_rows == 1


def test_a_missing_relative_path_says_where_it_was_looked_for(tmp_path: Path, monkeypatch) -> None:
    from miles.rollout.prompt_rows import DataError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        JsonlDataSource(DataConfig(prompt_data="launch/data/x.jsonl"), n_samples_per_prompt=1)
    assert str(info.value) == (
        f"prompt data 'launch/data/x.jsonl' (relative to the working directory {tmp_path}) does not exist or is "
        "not a file; check the path"
    )
    with pytest.raises(DataError, match=r"^prompt data '/x\.jsonl' does not exist"):  # an absolute one needs no note
        JsonlDataSource(DataConfig(prompt_data="/x.jsonl"), n_samples_per_prompt=1)
