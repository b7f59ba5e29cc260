"""The engine's tokenizer without transformers (`miles.utils.tokenizer_file`) against AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.models.resolve import resolve_spec
from miles.utils.tokenizer_file import FileTokenizer, file_tokenizer_refusal, load_engine_tokenizer

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "What is 12 + 345? Answer: 357.",
    "tabs\tand\nnewlines\n\n\nand \r\n crlf",
    "unicode: café, naïve, 日本語, 😀👍🏽, ∑ x_i² → ∞",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special<|im_end|>glued<|endoftext|>to text",
    "don't can't it's I'm we're they've ok , . ! ?",
    "a" * 300,
    "x = [1, 2, 3]\nfor i in x:\n    print(i ** 2)\n",
]


def _model_dirs() -> list:
    dirs = [pytest.param(resolve_spec(f"tiny:{arch}"), id=f"tiny-{arch}") for arch in ("llama", "qwen2", "qwen3")]
    try:
        from miles.recipes import smollm2

        smollm2.find_gguf()
        dirs.append(pytest.param("smollm2", id="smollm2"))
    except Exception:  # noqa: BLE001 - the wheel is an optional test dependency
        pass
    return dirs


@pytest.fixture(params=_model_dirs())
def model_dir(request) -> str:
    if request.param == "smollm2":
        from miles.recipes import smollm2

        return str(smollm2.converted_dir())
    return request.param


def test_matches_transformers_token_for_token(model_dir: str) -> None:
    assert file_tokenizer_refusal(model_dir) is None
    ours, theirs = load_engine_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(ours, FileTokenizer)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    for key in ("bos_token", "eos_token", "pad_token"):  # unk: model-specific classes add a default nothing uses
        assert getattr(ours, key) == getattr(theirs, key), key
        assert getattr(ours, f"{key}_id") == getattr(theirs, f"{key}_id"), key
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(50):  # any ids, partial UTF-8 sequences and special tokens included
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
        assert ours.decode(ids[0]) == theirs.decode([ids[0]])


def _edited_copy(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"tokenizer_class": "Qwen2Tokenizer"}, "tokenizer_class"),
        ({"auto_map": {"AutoTokenizer": ["x.T", None]}}, "auto_map"),
        ({"add_bos_token": True}, "add_bos_token"),
        ({"eos_token": "<|not-a-token|>"}, "not added tokens"),
    ],
)
def test_directories_transformers_would_treat_differently_go_through_transformers(tmp_path, changes, why) -> None:
    path = _edited_copy(resolve_spec("tiny:"), tmp_path / "m", **changes)
    assert why in file_tokenizer_refusal(path)
    if "auto_map" not in changes and "eos_token" not in changes:
        assert not isinstance(load_engine_tokenizer(path), FileTokenizer)
