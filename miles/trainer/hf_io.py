"""Load a HF model directory as-is and write HF safetensors exports.

The trainer keeps HF module names, so HF parameter names are simply `named_parameters()` names;
tied weights appear once (under the input embedding's name), as in HF checkpoints. An export is
sharded as `save_pretrained` shards: `model-0000i-of-0000N.safetensors` files of at most
`max_shard_bytes` each (one larger tensor gets a shard of its own) and `model.safetensors.index.json`
mapping every tensor to its file, which `from_pretrained`, SGLang and vLLM read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch
from torch import nn

from miles.trainer import varlen_attention
from miles.true_on_policy import ATTN_IMPLEMENTATION as TRUE_ON_POLICY_ATTENTION

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
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # save_pretrained's default "5GB"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_compute_dtype(dtype: str, device_type: str) -> torch.dtype:
    """`--dtype auto` is bf16 on GPU and fp32 on CPU; parameters stay fp32 (master) either way."""
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def trainer_attention(device: torch.device, compute_dtype: torch.dtype, model_cfg, train_cfg) -> str:
    """The FSDP trainer's attention: true-on-policy mode's eager reference attention, else
    `pick_attn_implementation` for `--attn-implementation`."""
    if train_cfg.true_on_policy_mode:
        return TRUE_ON_POLICY_ATTENTION
    return pick_attn_implementation(
        device, compute_dtype, model_cfg.hf_checkpoint, model_cfg.trust_remote_code, train_cfg.attn_implementation
    )


def pick_attn_implementation(
    device: torch.device,
    compute_dtype: torch.dtype,
    model_path: str,
    trust_remote_code: bool = False,
    requested: str = "auto",
) -> str:
    """The trainer's attention for the model at `model_path` (`--attn-implementation`).

    auto: varlen attention over packed rows (no padding) where a kernel for it runs, else SDPA over padded
    rows (miles.trainer.packing says why the layouts differ): flash_attention_2 when the flash-attn package
    is installed on GPU; otherwise `miles_varlen` (torch's own flash kernel, miles.trainer.varlen_attention)
    when the device, dtype and model allow it and the kernel passes a check against SDPA on this device;
    otherwise SDPA (always for remote-code models, whose attention need not go through transformers'
    attention interface). The choice and its reason are logged. miles_varlen asked for by name is refused
    (ValueError) for a model it cannot serve or a kernel that fails its check; the other names are passed
    to transformers as they are.
    """
    if requested not in ("auto", varlen_attention.NAME):
        logger.info("trainer attention: %s (--attn-implementation)", requested)
        return requested
    named = requested == varlen_attention.NAME
    if not named and device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    if trust_remote_code and named:
        raise ValueError(
            f"--attn-implementation {varlen_attention.NAME} cannot run here: remote-code model; use auto or sdpa"
        )
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}  # no readable config here: loading reports it
    use, why = (
        (False, "remote-code model")
        if trust_remote_code
        else varlen_attention.pick(device, compute_dtype, config, named=named)
    )
    if device.type == "cuda" or named:
        logger.info("trainer attention: %s (%s)", varlen_attention.NAME if use else "sdpa, padded rows", why)
    return varlen_attention.NAME if use else "sdpa"


def load_causal_lm(path: str, *, attn_implementation: str, trust_remote_code: bool = False) -> nn.Module:
    """The HF causal LM at `path`, fp32 on CPU (sharding moves it to the device afterwards)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory {path!r} does not exist; set --hf-checkpoint to a local HF dir")
    if attn_implementation == varlen_attention.NAME:
        varlen_attention.register()
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
    if attn_implementation == varlen_attention.NAME:
        varlen_attention.register()
    model = AutoModelForTokenClassification.from_pretrained(
        path,
        config=config,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    model.config.use_cache = False
    return model


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into shards of at most `max_shard_bytes` (a bigger tensor alone)."""
    shards: list[list[str]] = []
    shard_bytes = 0
    for name, nbytes in sizes:
        if not shards or (shards[-1] and shard_bytes + nbytes > max_shard_bytes):
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    return shards


def write_safetensors_shards(out_dir: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    """`model-0000i-of-0000N.safetensors` shards and their index in `out_dir`; the number of shards."""
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    shards = plan_shards([(name, t.numel() * t.element_size()) for name, t in tensors.items()], max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return len(shards)


def write_hf_dir(
    path: str,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    config,
    source_dir: str | None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `config.json`, sharded safetensors with their index, and the source dir's non-weight files
    (tokenizer, generation config, ...).

    Written into a sibling temp dir and renamed, so `path` is either absent or complete.
    """
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
        num_shards = write_safetensors_shards(tmp, tensors, max_shard_bytes)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported HF checkpoint to %s (%d tensors in %d shards)", path, len(tensors), num_shards)


def source_dtype(path: str) -> torch.dtype:
    """The dtype a HF directory's config declares (what an export should be written in); fp32 if unset."""
    from transformers import AutoConfig

    declared = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str):
        return _DTYPES.get(declared.replace("torch.", ""), torch.float32)
    return torch.float32
