"""Model FLOPs utilisation of the update, as `bench/train_throughput.py` counts it.

A training token of a sequence of length s costs 6 N + 12 L d s FLOPs (forward and backward: N
parameters, embeddings included, and attention over the s positions of its sequence; L layers,
hidden size d), so a sequence costs s (6 N + 12 L d s). MFU is the FLOPs of the step's samples
divided by the update's wall time and the peak dense bf16 rate of the GPUs that computed them.
The peak comes from the device name (`PEAK_BF16_FLOPS`); on other devices MFU is not reported.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import torch

# dense bf16 tensor-core peak by device name (NVIDIA's datasheets, no sparsity)
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("A100", 312e12))


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_params: int
    num_layers: int
    hidden_size: int


def safetensors_params(model_dir: str | Path) -> int:
    """Elements stored in the directory's safetensors files (read from their headers only)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def model_shape(model_dir: str | Path) -> ModelShape | None:
    """The shape of an HF checkpoint directory; None when it has no config or no safetensors weights."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    cfg = json.loads(config_path.read_text())
    cfg = cfg.get("text_config", cfg)
    n = safetensors_params(model_dir)
    if not n or "num_hidden_layers" not in cfg or "hidden_size" not in cfg:
        return None
    return ModelShape(n, int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]))


def train_flops(seq_lens: np.ndarray | list[int], shape: ModelShape) -> float:
    """Forward + backward FLOPs of one pass over sequences of these lengths."""
    s = np.asarray(seq_lens, dtype=np.float64)
    return float((s * (6.0 * shape.num_params + 12.0 * shape.num_layers * shape.hidden_size * s)).sum())


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak of a CUDA device, when its name is in the table."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def update_mfu(flops: float, update_s: float, peak_per_gpu: float | None, num_gpus: int) -> float | None:
    """MFU of an update that did `flops` in `update_s` on `num_gpus` GPUs; None without a known peak."""
    if peak_per_gpu is None or update_s <= 0:
        return None
    return flops / (update_s * peak_per_gpu * num_gpus)
