"""The engine's tokenizer without transformers (`miles.utils.tokenizer_file`) against AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
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
        from miles.utils.gguf import missing_gguf_deps

        smollm2.find_gguf()
        if not missing_gguf_deps():  # converting the GGUF needs gguf and accelerate
            dirs.append(pytest.param("smollm2", id="smollm2", marks=pytest.mark.xdist_group("smollm2")))
    except Exception:  # noqa: BLE001 - the wheel is an optional test dependency
        pass
    return dirs


@pytest.fixture(params=_model_dirs())
def model_dir(request) -> str:
    if request.param == "smollm2":  # converted once a session (tests/conftest.py)
        return str(request.getfixturevalue("smollm2_hf_dir"))
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


# ---- the controller's tokenizer: chat templates rendered without transformers -----------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcødé 😀"}],
    [
        {"role": "user", "content": "What is 7 * 6?"},
        {"role": "assistant", "content": "42", "tool_calls": None},
        {"role": "user", "content": "And 6 * 7?"},
    ],
]
# A template of our own that uses what chat templates use: tojson with options, namespace, loop controls,
# dict, special tokens, tools, extra variables and raise_exception.
OWN_TEMPLATE = """{{ bos_token or '' }}{% set ns = namespace(n=0) %}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif %}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}
{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
{%- if loop.index > 5 %}{% break %}{% endif %}
<|im_start|>{{ m.role }}{{ dict(k=1) | tojson }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant{% if think is defined and not think %} no-think{% endif %}
{% endif %}{{ ns.n }}{{ eos_token }}{{ pad_token }}"""


def _own_template_dir(tmp_path: Path) -> str:
    path = _edited_copy(resolve_spec("tiny:llama"), tmp_path / "own")
    (Path(path) / "chat_template.jinja").write_text(OWN_TEMPLATE)
    return path


def _render_both(ours, theirs, *args, **kwargs):
    a, b = ours.apply_chat_template(*args, **kwargs), theirs.apply_chat_template(*args, **kwargs)
    assert a == b, (args, kwargs)
    return a


def _check_templates(path: str) -> None:
    from miles.utils.tokenizer_file import ChatFileTokenizer, load_controller_tokenizer

    ours, theirs = load_controller_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(ours, ChatFileTokenizer) and ours.chat_template == theirs.chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = _render_both(ours, theirs, conv, tokenize=False, add_generation_prompt=gen)
            ids = _render_both(ours, theirs, conv, tokenize=True, return_dict=False, add_generation_prompt=gen)
            assert ids == theirs(text, add_special_tokens=False)["input_ids"]
            _render_both(ours, theirs, conv, tools=TOOLS, tokenize=False, add_generation_prompt=gen)
            _render_both(ours, theirs, conv, tokenize=False, add_generation_prompt=gen, think=False)
    assert ours._hf is None  # all of the above rendered here, without transformers
    # calls outside the rendered subset go to transformers and give its answers
    _render_both(ours, theirs, CONVERSATIONS[2], continue_final_message=True, tokenize=False)
    assert dict(ours.apply_chat_template(CONVERSATIONS[0])) == dict(theirs.apply_chat_template(CONVERSATIONS[0]))
    assert ours.convert_ids_to_tokens([1, 2]) == theirs.convert_ids_to_tokens([1, 2])
    assert ours.convert_tokens_to_ids(["a", "b"]) == theirs.convert_tokens_to_ids(["a", "b"])
    assert ours.encode("hi there", truncation=True, max_length=2) == theirs.encode(
        "hi there", truncation=True, max_length=2
    )
    ids = np.array(theirs.encode("hi there"))
    assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids.tolist()) == theirs.decode(ids.tolist())


def test_chat_templates_render_as_transformers_renders_them(model_dir: str) -> None:
    _check_templates(model_dir)


def test_the_controller_tokenizer_survives_pickling_and_deep_copies() -> None:
    import copy
    import pickle

    from miles.utils.tokenizer_file import load_controller_tokenizer

    tok = load_controller_tokenizer(resolve_spec("tiny:"))
    want = tok.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    for other in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert other.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) == want
        assert other.decode(other.encode("hello 42")) == tok.decode(tok.encode("hello 42"))


def test_a_template_using_the_sandboxs_globals_and_filters_renders_the_same(tmp_path) -> None:
    from jinja2.exceptions import TemplateError

    path = _own_template_dir(tmp_path)
    _check_templates(path)
    from miles.utils.tokenizer_file import load_controller_tokenizer

    ours, theirs = load_controller_tokenizer(path), AutoTokenizer.from_pretrained(path)
    bad = [{"role": "robot", "content": "x"}]
    for tok in (ours, theirs):
        with pytest.raises(TemplateError, match="bad role robot"):
            tok.apply_chat_template(bad, tokenize=False)


def test_named_templates_are_transformers_own(tmp_path) -> None:
    from miles.utils.tokenizer_file import ChatFileTokenizer, load_controller_tokenizer

    path = Path(_own_template_dir(tmp_path))
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages[0].content }}")
    ours, theirs = load_controller_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, ChatFileTokenizer) and ours.chat_template == theirs.chat_template
    for tools in (None, TOOLS):
        _render_both(ours, theirs, CONVERSATIONS[0], tools=tools, tokenize=False)


def _qwen2_class_dir(tmp_path: Path) -> Path:
    """A directory whose tokenizer_config names the model-specific `Qwen2Tokenizer` (which rebuilds its
    pipeline, NFC normalizer included, from the file's vocabulary and merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    base.train_from_iterator([t for t in TEXTS if t] * 3, trainer)
    raw = json.loads(base.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=raw["vocab"], merges=[tuple(m) if isinstance(m, list) else tuple(m.split()) for m in raw["merges"]],
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")  # fmt: skip
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    out = tmp_path / "qwen2-class"
    tok.save_pretrained(str(out))
    return out


def test_a_recorded_check_lets_a_model_specific_class_run_from_its_file(tmp_path: Path) -> None:
    from miles.utils import tokenizer_file

    path = _qwen2_class_dir(tmp_path)
    assert "Qwen2Tokenizer" in file_tokenizer_refusal(path)
    assert tokenizer_file.record_file_tokenizer(path) is None
    assert file_tokenizer_refusal(path) is None
    ours, theirs = load_engine_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, FileTokenizer)
    for text in [*TEXTS, "cafe\u0301 \u212b \ufb01"]:  # not NFC: the class normalizes, and so does the file now
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)

    # the record vouches for this file under this transformers only
    record = json.loads((path / tokenizer_file.VERIFIED_RECORD).read_text())
    (path / tokenizer_file.VERIFIED_RECORD).write_text(json.dumps({**record, "transformers": "0.0"}))
    assert "Qwen2Tokenizer" in file_tokenizer_refusal(path)
    (path / tokenizer_file.VERIFIED_RECORD).write_text(json.dumps(record))
    assert file_tokenizer_refusal(path) is None
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["normalizer"] = None  # the file changed since it was checked
    (path / "tokenizer.json").write_text(json.dumps(spec))
    assert "Qwen2Tokenizer" in file_tokenizer_refusal(path)


def test_no_record_where_the_file_cannot_match_transformers(tmp_path: Path, monkeypatch) -> None:
    from miles.utils import tokenizer_file

    path = _qwen2_class_dir(tmp_path)
    real = tokenizer_file.FileTokenizer.encode

    def off_by_one(self, text, add_special_tokens=True):
        return [*real(self, text, add_special_tokens), 0]

    monkeypatch.setattr(tokenizer_file.FileTokenizer, "encode", off_by_one)
    why = tokenizer_file.record_file_tokenizer(path)
    assert why is not None and "encodes" in why
    assert not (path / tokenizer_file.VERIFIED_RECORD).exists()
    assert "Qwen2Tokenizer" in file_tokenizer_refusal(path)
