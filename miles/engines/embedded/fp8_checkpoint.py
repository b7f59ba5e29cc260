"""FP8 checkpoints (fp8.py's format): `miles convert fp8 SRC DST` writes one from a BF16 HF directory;
`load_fp8_model` reads one into the engine's model.

The decoder's linear weights become e4m3 with a `weight_scale_inv` per 128x128 block; everything else
(embeddings, norms, biases, LM head, tokenizer files) is copied as it is; config.json gains the
`quantization_config` that makes the embedded engine serve it in FP8.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import ModelSpec, iter_safetensors, read_config
from miles.engines.embedded.model import CausalLM


def write_fp8_checkpoint(src: str, dst: str) -> str:
    """Write the FP8 form of the HF directory `src` into `dst` (created; refused if it holds a checkpoint)."""
    config = read_config(src)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config']}); convert a bf16 checkpoint")
    if os.path.exists(os.path.join(dst, "config.json")):
        raise ValueError(f"{dst} already holds a checkpoint; pick an empty directory")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in ("config.json",):
            if not name.endswith(".safetensors.index.json"):
                shutil.copy2(path, os.path.join(dst, name))
    tensors = fp8.convert_state((n, t.contiguous()) for n, t in iter_safetensors(src))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = dict(fp8.QUANT_CONFIG)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def load_fp8_model(model_path: str, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """An FP8 checkpoint: dequantized per block to `dtype`, fused, then requantized per block on `device`."""
    spec = ModelSpec.from_config(read_config(model_path))
    params = {
        name: t.to(device)
        for name, t in fp8.read_checkpoint(iter_safetensors(model_path), dtype).items()
        if name != "lm_head.weight" or not spec.tie_word_embeddings
    }
    model = CausalLM(spec, params, device, dtype)
    model.quantize_fp8()
    return model
