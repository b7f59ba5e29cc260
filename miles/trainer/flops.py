"""Model FLOPs utilisation of the update: the matmul FLOPs the step's samples need, over its wall time.

A sequence of length s whose r positions predict a trained token costs, forward and backward,
6 s N_body + 6 r V d + 12 L d s^2 FLOPs:
- N_body: the weights every position multiplies by (attention and MLP projections; for a mixture of
  experts, the k of E experts a token is routed to, so k/E of the expert weights);
- V d: the LM head, applied only to the positions that predict a trained token (the trainer keeps
  those logits only);
- 12 L d s: attention over the s positions of the sequence (L layers, hidden size d), per position.
The input embedding is a lookup and costs no FLOPs: counted as a weight (6 N with N every stored
parameter, as `bench/train_throughput.py` counts a tied model training on every position), it would
add the whole vocabulary matrix once more for an untied model and charge the head for prompt
positions. The peak comes from the device name (`PEAK_BF16_FLOPS`); on other devices MFU is not reported.
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
    body_params: int  # weights every position multiplies by (routed experts: the active share)
    num_layers: int
    hidden_size: int
    head_params: int = 0  # the LM head, vocab x hidden


def _stored_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the directory's safetensors files (read from their headers only)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update((k, v["shape"]) for k, v in header.items() if k != "__metadata__")
    return shapes


def model_shape(model_dir: str | Path) -> ModelShape | None:
    """The FLOPs shape of an HF checkpoint directory; None when it has no config or no safetensors weights.

    Vocabulary matrices (the input embedding, and the LM head when untied) leave the body; one of them is
    the head. Expert weights (`.experts.` in the name) count k/E of themselves, k and E from the config."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    cfg = json.loads(config_path.read_text())
    cfg = cfg.get("text_config", cfg)
    shapes = _stored_shapes(model_dir)
    if not shapes or "num_hidden_layers" not in cfg or "hidden_size" not in cfg:
        return None
    d, vocab = int(cfg["hidden_size"]), int(cfg.get("vocab_size", 0))
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    topk = int(cfg.get("num_experts_per_tok") or 0)
    body = head = 0.0
    for name, shape in shapes.items():
        n = prod(shape)
        if vocab and len(shape) == 2 and sorted(shape) == sorted((vocab, d)):
            head = n  # embedding or head: either is V x d, and only one multiplies
        elif experts and topk and ".experts." in name:
            body += n * topk / experts
        else:
            body += n
    return ModelShape(int(body), int(cfg["num_hidden_layers"]), d, int(head))


def train_flops(
    seq_lens: np.ndarray | list[int], shape: ModelShape, head_rows: np.ndarray | list[int] | None = None
) -> float:
    """Forward + backward FLOPs of one pass over sequences of these lengths, the LM head applied to
    `head_rows` positions of each (default: all of them)."""
    s = np.asarray(seq_lens, dtype=np.float64)
    rows = s if head_rows is None else np.asarray(head_rows, dtype=np.float64)
    body = (s * (6.0 * shape.body_params + 12.0 * shape.num_layers * shape.hidden_size * s)).sum()
    return float(body + 6.0 * shape.head_params * rows.sum())


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
