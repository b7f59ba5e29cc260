"""A model directory's `tokenizer.json`, run by the `tokenizers` library without transformers.

Importing transformers (and torch under it) to tokenise costs seconds per process on slow file
systems; an engine needs only encode, decode, the vocabulary and its special ids. `load_engine_tokenizer`
returns a `FileTokenizer` when transformers itself would run that same file unchanged, and
transformers' AutoTokenizer otherwise:

- `tokenizer_class` is one of the generic classes (`TokenizersBackend`, `PreTrainedTokenizerFast`):
  model-specific classes may rebuild parts of the pipeline from the config;
- no custom code (`auto_map`), no `add_bos_token` / `add_eos_token` override of the file's
  post-processor, no `split_special_tokens`, no clean-up of spaces (or a BPE model, where
  transformers skips it), a vocabulary of at most 100,000 entries (above it transformers may patch
  the pre-tokenizer's regex);
- every special token the config names is an added token of the file.

A model-specific class or a larger vocabulary is accepted where `miles_tokenizer.json` beside the file
says this file was checked against transformers' tokenizer of the directory, under the transformers version
installed now, and the file is unchanged since (its sha256). `record_file_tokenizer` writes that record
where it holds: a converted GGUF checkpoint (gguf.py) saves transformers' own pipeline as `tokenizer.json`
(for Qwen2 it adds the NFC normalizer the class applies) and records it once the two encode and decode a
probe text alike. Its conversion then costs one more tokenizer load, and every later load of the
directory (engine, controller) a few hundred milliseconds instead of seconds.

The controller's `ChatFileTokenizer` adds the chat template, rendered in the sandbox transformers
renders in, and hands every other call to transformers' tokenizer, loaded on first use
(`load_controller_tokenizer`). `tests/unit/test_tokenizer_file.py` checks both against AutoTokenizer,
token for token and template for template.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
MAX_VOCAB = 100_000


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs: {"content": "<|im_end|>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: Path) -> dict:
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as in transformers
        f = path / name
        if f.is_file():
            config.update(json.loads(f.read_text()))
    return config


VERIFIED_RECORD = "miles_tokenizer.json"
PROBE_TEXTS = (
    "Solve: 12 + 7 = ? Put the answer in \\boxed{}.\n\n  Two  spaces, a tab\t, a\r\nnew line.",
    "caf\u00e9 / cafe\u0301, \u212b, \ufb01, \uff21\uff22\uff23, \u4e2d\u6587\uff0c\u6807\u70b9\u3002 \U0001f600 1234567890",
    "def f(x):\n    return x ** 2  # comment\n",
)


def _installed_transformers() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(path: Path, config: dict) -> bool:
    """Whether `miles_tokenizer.json` vouches for this directory's tokenizer.json as it is now (module doc)."""
    try:
        record = json.loads((path / VERIFIED_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return (
        record.get("tokenizer_class") == config.get("tokenizer_class")
        and record.get("transformers") == _installed_transformers()
        and record.get("tokenizer_json_sha256") == _sha256(path / "tokenizer.json")
    )


def record_file_tokenizer(model_dir: str | Path) -> str | None:
    """Save transformers' tokenizer of `model_dir` as its `tokenizer.json` and, where the file tokenizer
    then encodes and decodes the probe texts as transformers does, write the record that lets it stand in
    (module doc). Returns why not (None: recorded)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = Path(model_dir)
    (path / VERIFIED_RECORD).unlink(missing_ok=True)
    hf = AutoTokenizer.from_pretrained(str(path))
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return f"{type(hf).__name__} has no tokenizers pipeline to save"
    backend.save(str(path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(path))  # as every later load builds it, from the saved file
    config = _read_config(path)
    mine = FileTokenizer(path, Tokenizer.from_file(str(path / "tokenizer.json")), config)
    texts = [*PROBE_TEXTS, "".join(t for t in (getattr(hf, k, None) for k in SPECIAL_KEYS) if isinstance(t, str))]
    for text in texts:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            if mine.encode(text, add_special_tokens=special) != ids:
                return f"the file encodes {text[:30]!r} otherwise than transformers"
            for skip in (True, False):
                if mine.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                    return f"the file decodes {text[:30]!r} otherwise than transformers"
    record = {
        "tokenizer_class": config.get("tokenizer_class"),
        "transformers": _installed_transformers(),
        "tokenizer_json_sha256": _sha256(path / "tokenizer.json"),
    }
    (path / VERIFIED_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return None


def _examine(path: Path) -> tuple[str | None, Any, dict]:
    """(why the directory's tokenizer must go through transformers, or None; the file's tokenizer; the
    config), each file read once."""
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return "no tokenizer.json + tokenizer_config.json", None, {}
    config = _read_config(path)
    verified = _verified(path, config)
    if config.get("tokenizer_class") not in GENERIC_CLASSES and not verified:
        return f"tokenizer_class {config.get('tokenizer_class')!r}", None, config
    for key in ("auto_map", "add_bos_token", "add_eos_token", "split_special_tokens"):
        if config.get(key):
            return f"{key} is set", None, config
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if tok.get_vocab_size(with_added_tokens=False) > MAX_VOCAB and not verified:
        return f"a vocabulary above {MAX_VOCAB}", tok, config
    if config.get("clean_up_tokenization_spaces") and type(tok.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE model", tok, config
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    named = [_token_text(config.get(k)) for k in SPECIAL_KEYS]
    named += [
        _token_text(t) for t in config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    ]
    missing = [t for t in named if t is not None and t not in added]
    if missing:
        return f"special tokens {missing[:3]} are not added tokens of tokenizer.json", tok, config
    return None, tok, config


def file_tokenizer_refusal(model_path: str | Path) -> str | None:
    """Why this directory's tokenizer must go through transformers; None when `FileTokenizer` matches it."""
    return _examine(Path(model_path))[0]


class FileTokenizer:
    """The subset of a transformers tokenizer an engine uses, from `tokenizer.json` and its config.

    Built by `load_engine_tokenizer` / `load_controller_tokenizer`, which examine the directory first.
    """

    def __init__(self, model_path: str | Path, tok: Any, config: dict) -> None:
        path = Path(model_path)
        self.name_or_path = str(path)
        self._tok = tok
        for key in SPECIAL_KEYS:
            text = _token_text(config.get(key))
            setattr(self, key, text)
            setattr(self, f"{key}_id", None if text is None else self._tok.token_to_id(text))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch_ids(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of many texts in one call (the Rust tokenizer spreads them over the cores)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these: not rendered here
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_JSON_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """JSON data only (what a chat template sees unchanged in transformers)."""
    if type(value) in _JSON_SCALARS:
        return True
    if type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def _compile_template(source: str):
    """A chat template in the sandbox transformers renders in, with the same filters and globals."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatFileTokenizer(FileTokenizer):
    """`FileTokenizer` plus the model's chat template, rendered as transformers renders it, for the controller.

    The common call (one conversation of JSON messages, JSON tools, text or plain ids out) is rendered
    here; any other call, and any attribute this class lacks, goes to transformers' tokenizer for the
    same directory, loaded on first use. `tests/unit/test_tokenizer_file.py` renders both ways.
    """

    def __init__(self, model_path: str | Path, tok: Any, config: dict) -> None:
        super().__init__(model_path, tok, config)
        path = Path(model_path)
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        named = (path / "additional_chat_templates").is_dir() or not isinstance(template, (str, type(None)))
        if not named:  # named templates: `chat_template` is transformers' own (a dict), through __getattr__
            self.chat_template = template
        self._renderable = bool(template) and not named and not _GENERATION_TAG.search(template)
        self._compiled = None
        self._template_tokens = {k: getattr(self, k) for k in SPECIAL_KEYS if getattr(self, k) is not None}
        self._hf = None
        self._hf_lock = threading.Lock()

    @property
    def hf(self) -> Any:
        """transformers' tokenizer for this directory (imported and loaded on first use)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                logger.info(
                    "loading transformers' tokenizer for %s (a call the file tokenizer leaves to it)",
                    self.name_or_path,
                )
                self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
            return self._hf

    def __getstate__(self) -> dict:  # picklable and deep-copyable, as transformers' tokenizers are
        return {**self.__dict__, "_hf_lock": None, "_compiled": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _hf_lock=threading.Lock())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_hf", "_hf_lock"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        return super().__call__(text, add_special_tokens=add_special_tokens)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return super().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        plain = type(ids) is int or (isinstance(ids, (list, tuple)) and all(type(i) is int for i in ids))
        if kwargs or not plain:  # tensors, arrays, batches, transformers' options
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return super().decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        return (
            super().convert_tokens_to_ids(tokens) if isinstance(tokens, str) else self.hf.convert_tokens_to_ids(tokens)
        )

    def apply_chat_template(
        self,
        conversation: Any,
        tools: Any = None,
        documents: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        own = (
            self._renderable
            and chat_template in (None, self.chat_template)
            and documents is None
            and not continue_final_message
            and (not tokenize or not return_dict)
            and isinstance(conversation, list)
            and len(conversation) > 0
            and all(type(m) is dict and _plain(m) for m in conversation)
            and not any(m.get(k) is not None for m in conversation for k in _REASONING_KEYS)
            and (tools is None or (isinstance(tools, list) and _plain(tools)))
            and _plain(kwargs)
            and not {"sanitize_control_tokens", "return_assistant_tokens_mask", "tokenizer_kwargs"} & set(kwargs)
            and not {"padding", "truncation", "max_length", "return_tensors"} & set(kwargs)
        )
        if not own:
            return self.hf.apply_chat_template(
                conversation,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=tokenize,
                return_dict=return_dict,
                **kwargs,
            )
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]  # as transformers drops None
        text = self._compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self._template_tokens, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _load(model_path: str | Path, cls: type[FileTokenizer], trust_remote_code: bool = False) -> Any:
    why, tok, config = ("trust_remote_code", None, {}) if trust_remote_code else _examine(Path(model_path))
    if why is None:
        return cls(model_path, tok, config)
    logger.info("tokenizer of %s through transformers: %s", model_path, why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)


def load_controller_tokenizer(model_path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """`ChatFileTokenizer` where the file matches transformers' tokenizer (and no remote code is asked
    for), else AutoTokenizer."""
    return _load(model_path, ChatFileTokenizer, trust_remote_code)


def load_engine_tokenizer(model_path: str | Path) -> Any:
    """`FileTokenizer` where it matches transformers' tokenizer for this directory, else AutoTokenizer."""
    return _load(model_path, FileTokenizer)
