"""GGUF file -> plain Hugging Face directory (dequantized safetensors, tokenizer, chat template).

transformers reads GGUF when `gguf` and `accelerate` are installed: it dequantizes every tensor on
load, but keeps a GGUF quantizer attached to the model, which refuses `save_pretrained`. The
tensors it holds are ordinary dense tensors by then, so dropping the quantizer (and the
`quantization_config` entry, which would send later loaders looking for it) gives a directory any
loader, the trainer and the embedded engine included, reads like a normal checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32")


class GGUFConvertError(RuntimeError):
    """The GGUF file or the environment cannot produce an HF directory; the message says the fix."""


def missing_gguf_deps() -> list[str]:
    """The packages transformers needs to read GGUF that are not installed."""
    return [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Dequantize `src` and write a plain HF checkpoint (config, safetensors, tokenizer) to `out_dir`."""
    missing = missing_gguf_deps()
    if missing:
        raise GGUFConvertError(f"reading GGUF needs {' and '.join(missing)}; run: pip install 'miles[gguf]'")
    path = Path(src)
    if not path.is_file():
        raise GGUFConvertError(f"{src} is not a file; pass the path of a .gguf file")
    if dtype not in DTYPES:
        raise GGUFConvertError(f"dtype={dtype!r} is not one of {DTYPES}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    logger.info("dequantizing %s (%.1f MB) to %s", path, path.stat().st_size / 2**20, dtype)
    with _parse_once():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    _drop_quantizer(model)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _record_tokenizer(out)
    _check_written(out)
    logger.info("wrote %s (%s, %.1fM params)", out, type(model).__name__, model.num_parameters() / 1e6)
    return out


def _record_tokenizer(out: Path) -> None:
    """Let later loads of `out` run its tokenizer.json without transformers where that is exact
    (tokenizer_file.record_file_tokenizer); where it is not, they go through transformers as before."""
    from miles.utils.tokenizer_file import record_file_tokenizer

    try:
        why = record_file_tokenizer(out)
    except Exception as e:  # noqa: BLE001 - a speed-up only: the checkpoint is complete without it
        why = f"{type(e).__name__}: {e}"
    if why is None:
        logger.info("%s: its tokenizer.json runs without transformers (checked against it)", out)
    else:
        logger.info("%s: its tokenizer goes through transformers: %s", out, why)


@contextlib.contextmanager
def _parse_once() -> Iterator[None]:
    """Within the block, one `gguf.GGUFReader` per file and one tensor-name table per (arch, layers).

    transformers parses the whole file (metadata, a vocabulary of 49K strings for SmolLM2) for the config,
    again for the tokenizer and again for the weights, and rebuilds gguf's tensor-name table for every
    module of the model (397 times for SmolLM2): most of a conversion's time. Both are read-only once built,
    and transformers imports both names from `gguf` when it calls them, so sharing them here changes
    nothing it reads. The originals are back when the block ends."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _drop_quantizer(model) -> None:
    """Forget the GGUF quantizer: the loaded tensors are already dense."""
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)


def _check_written(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise GGUFConvertError(f"{out}/config.json still has quantization_config; loaders would look for a quantizer")
    if not list(out.glob("*.safetensors")):
        raise GGUFConvertError(f"{out} has no .safetensors file after saving")
