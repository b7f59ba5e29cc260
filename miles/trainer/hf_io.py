"""Load a HF model directory as-is and write HF safetensors exports.

The trainer keeps HF module names, so HF parameter names are simply `named_parameters()` names;
tied weights appear once (under the input embedding's name), as in HF checkpoints.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def resolve_compute_dtype(dtype: str, device_type: str) -> torch.dtype:
    """`--dtype auto` is bf16 on GPU and fp32 on CPU; parameters stay fp32 (master) either way."""
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def pick_attn_implementation(device_type: str) -> str:
    """flash_attention_2 (varlen over packed rows) when the package is there on GPU, else SDPA.

    SDPA handles packed rows through the block-diagonal mask transformers derives from position
    ids that restart per sequence.
    """
    if device_type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_causal_lm(path: str, *, attn_implementation: str, trust_remote_code: bool = False) -> nn.Module:
    """The HF causal LM at `path`, fp32 on CPU (sharding moves it to the device afterwards)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory {path!r} does not exist; set --hf-checkpoint to a local HF dir")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    model.config.use_cache = False
    return model


def load_value_model(path: str, *, attn_implementation: str, trust_remote_code: bool = False) -> nn.Module:
    """The PPO critic: the HF backbone with a scalar head (token classification, 1 label).

    HF's token-classification head puts dropout (default 0.1) before the score layer; a critic
    has none, or its training values would be noisy and differ from the old values it clips to.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(
        path,
        config=config,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    model.config.use_cache = False
    return model


def write_hf_dir(
    path: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *, config, source_dir: str | None
) -> None:
    """Write `config.json`, `model.safetensors` and the source dir's non-weight files (tokenizer, ...).

    Written into a sibling temp dir and renamed, so `path` is either absent or complete.
    """
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf_export_", dir=parent)
    try:
        if source_dir and os.path.isdir(source_dir):
            for name in os.listdir(source_dir):
                src = os.path.join(source_dir, name)
                if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(src, os.path.join(tmp, name))
        config.save_pretrained(tmp)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported HF checkpoint to %s (%d tensors)", path, len(tensors))


def source_dtype(path: str) -> torch.dtype:
    """The dtype a HF directory's config declares (what an export should be written in); fp32 if unset."""
    from transformers import AutoConfig

    declared = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str):
        return _DTYPES.get(declared.replace("torch.", ""), torch.float32)
    return torch.float32
