"""HF tensors in and out of the megatron backend's model: read from a checkpoint, streamed back out.

In: `read_hf_tensors` reads the named HF tensors of a safetensors directory; expert tensors asked for
by per-expert name are also found in a checkpoint that holds them fused (transformers >= 5 names).

Out: `named_hf_tensors` yields every HF tensor of the model, full, in the same order on every rank:
tensor-parallel shards are all-gathered; an MoE layer's experts are stacked per rank, all-gathered over
the expert-tensor-parallel ranks, then over the expert-parallel ranks (rank order is expert order);
each pipeline stage broadcasts its layers to the other stages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from miles.trainer import mcore_convert as mc
from miles.trainer import mcore_moe_convert as moe
from miles.utils.moe_names import PER_EXPERT, per_expert_tensors


def _weight_map(path: str) -> dict[str, str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _fused_name(name: str) -> str | None:
    m = PER_EXPERT.match(name)
    if m is None:
        return None
    return f"{m['prefix']}.{'down_proj' if m['which'] == 'down_proj' else 'gate_up_proj'}"


def read_hf_tensors(path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a HF safetensors directory (one file or an index of shards)."""
    from safetensors import safe_open

    where = _weight_map(path)
    wanted = {n: n if n in where else _fused_name(n) for n in names}  # per-expert name -> the tensor holding it
    missing = sorted(n for n, src in wanted.items() if src not in where)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {missing[:3]} ({len(missing)} tensors)")
    sources = set(wanted.values())
    out: dict[str, torch.Tensor] = {}
    for file in sorted({where[src] for src in sources}):
        with safe_open(os.path.join(path, file), framework="pt", device="cpu") as f:
            for src in sorted(s for s in sources if where[s] == file):
                out.update((n, t.clone()) for n, t in per_expert_tensors(src, f.get_tensor(src)))
    return {n: out[n] for n in names}


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def full_tensor(params: dict[str, torch.Tensor], mname: str, s: mc.ModelShape) -> torch.Tensor:
    """The full (unsharded) Megatron-side tensor `mname` of this pipeline stage (collective over its groups)."""
    kind = mc.parallel_kind(mname)
    if kind.startswith("expert"):
        ep = ps.get_expert_model_parallel_world_size()
        local = torch.stack([params[n].detach() for n in moe.local_expert_names(mname, s.num_experts // ep)])
        if ps.get_expert_tensor_parallel_world_size() > 1:
            local = mc.gather_shards(mname, _all_gather(local, ps.get_expert_tensor_parallel_group()))
        return torch.cat(_all_gather(local, ps.get_expert_model_parallel_group())) if ep > 1 else local
    shard = params[mname].detach()
    if ps.get_tensor_model_parallel_world_size() == 1 or kind == "whole":
        return shard
    return mc.gather_shards(mname, _all_gather(shard, ps.get_tensor_model_parallel_group()))


def named_hf_tensors(
    module: torch.nn.Module, s: mc.ModelShape, device: torch.device, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model (`dtype`, or the parameters' own), the same stream on every rank."""
    params = dict(module.named_parameters())
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    for stage, mname, hnames in mc.hf_export_names(s, pp_size):
        if stage == pp_rank:
            pairs = mc.to_hf(mname, full_tensor(params, mname, s), hnames, s)
            tensors = [(t.to(dtype) if dtype is not None else t).contiguous() for _, t in pairs]
        else:  # filled by the owning stage's broadcast below
            tensors = [torch.empty(mc.hf_shape(h, s), dtype=dtype or torch.float32, device=device) for h in hnames]
        if pp_size > 1:
            owner = dist.get_global_rank(pp_group, stage)
            for t in tensors:
                dist.broadcast(t, src=owner, group=pp_group)
        yield from zip(hnames, tensors, strict=True)
