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

`tests/unit/test_tokenizer_file.py` checks the result against AutoTokenizer token for token.
"""

from __future__ import annotations

import json
import logging
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


def file_tokenizer_refusal(model_path: str | Path) -> str | None:
    """Why this directory's tokenizer must go through transformers; None when `FileTokenizer` matches it."""
    path = Path(model_path)
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return "no tokenizer.json + tokenizer_config.json"
    config = _read_config(path)
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r}"
    for key in ("auto_map", "add_bos_token", "add_eos_token", "split_special_tokens"):
        if config.get(key):
            return f"{key} is set"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if tok.get_vocab_size(with_added_tokens=False) > MAX_VOCAB:
        return f"a vocabulary above {MAX_VOCAB}"
    if config.get("clean_up_tokenization_spaces") and type(tok.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE model"
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    named = [_token_text(config.get(k)) for k in SPECIAL_KEYS]
    named += [
        _token_text(t) for t in config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    ]
    missing = [t for t in named if t is not None and t not in added]
    if missing:
        return f"special tokens {missing[:3]} are not added tokens of tokenizer.json"
    return None


class FileTokenizer:
    """The subset of a transformers tokenizer an engine uses, from `tokenizer.json` and its config."""

    def __init__(self, model_path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_path)
        self.name_or_path = str(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_config(path)
        for key in SPECIAL_KEYS:
            text = _token_text(config.get(key))
            setattr(self, key, text)
            setattr(self, f"{key}_id", None if text is None else self._tok.token_to_id(text))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def load_engine_tokenizer(model_path: str | Path) -> Any:
    """`FileTokenizer` where it matches transformers' tokenizer for this directory, else AutoTokenizer."""
    why = file_tokenizer_refusal(model_path)
    if why is None:
        return FileTokenizer(model_path)
    logger.info("tokenizer of %s through transformers: %s", model_path, why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
