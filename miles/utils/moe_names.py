"""The two names a mixture-of-experts checkpoint gives its expert weights, and the map between them.

transformers >= 5 holds a layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj` [E, 2I, D]
(gate rows first, then up) and `mlp.experts.down_proj` [E, D, I]; checkpoints on disk, older
transformers, SGLang's loader and Megatron's converters name every expert's matrices apart:
`mlp.experts.{e}.gate_proj.weight` [I, D], `up_proj.weight` [I, D], `down_proj.weight` [D, I].
The weight stream the trainer sends uses the per-expert names (what every engine loads); the
embedded engine accepts both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<which>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<which>gate_proj|up_proj|down_proj)\.weight$"
)


def per_expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) itself, or, for a fused expert tensor, each expert's matrices under their own
    names: views of `tensor` (row blocks of a contiguous tensor, so contiguous themselves)."""
    m = FUSED_EXPERTS.match(name)
    if m is None:
        yield name, tensor
        return
    prefix = m["prefix"]
    if tensor.dim() != 3:
        raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}; a fused expert tensor is 3-D [experts, out, in]")
    if m["which"] == "down_proj":
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        return
    rows = tensor.shape[1]
    if rows % 2:
        raise ValueError(f"{name!r} has {rows} rows; gate_up_proj stacks gate and up, an even count")
    half = rows // 2
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
        yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]


def split_fused_experts(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every fused expert tensor replaced by its per-expert matrices (others unchanged)."""
    for name, tensor in named:
        yield from per_expert_tensors(name, tensor)
