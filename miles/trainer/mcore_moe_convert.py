"""HF <-> megatron-core names and layouts of Qwen3-MoE's mixture-of-experts layers, in plain torch.

A Qwen3-MoE layer's MLP is a router (`mlp.gate.weight` [E, D], HF) and E experts, each a gated MLP
of width I = `moe_intermediate_size`. HF names the experts either per expert
(`mlp.experts.{e}.gate_proj.weight` [I, D], `up_proj` [I, D], `down_proj` [D, I]: checkpoints on disk,
the weight stream) or fused (transformers >= 5 in memory: `mlp.experts.gate_up_proj` [E, 2I, D],
`mlp.experts.down_proj` [E, D, I]); `per_expert_view` reads either (miles/utils/moe_names.py).

megatron-core's MoE layer (SequentialMLP experts) holds `mlp.router.weight` [E, D], whole on every rank,
and on expert-parallel rank r the L = E / EP experts r*L .. r*L + L-1 as
`mlp.experts.local_experts.{i}.linear_fc1.weight` (gate || up) and `linear_fc2.weight` (down), split
over the expert-tensor-parallel ranks as the dense fc1 / fc2 are over TP: fc1 shard j = cat(gate rows j,
up rows j), fc2 shard j = columns j.

For export every expert of a layer travels as one stacked Megatron-side tensor,
`mlp.experts.linear_fc1.weight` [E, 2I, D] / `mlp.experts.linear_fc2.weight` [E, D, I]: an EP rank
stacks its L local experts, the expert-TP shards are gathered (`gather_expert_tp`), the EP ranks'
stacks are concatenated in rank order (which is expert order), and `stack_to_hf` names each expert.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from miles.utils.moe_names import FUSED_EXPERTS, split_fused_experts

STACK = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<which>linear_fc1|linear_fc2)\.weight$")
LOCAL_EXPERT = ".mlp.experts.local_experts."
_HF_EXPERT = re.compile(r"^mlp\.experts\.\d+\.")


def moe_fields(cfg) -> dict:
    """The MoE fields of `ModelShape` from a HF qwen3_moe config, refusing the layouts not converted."""
    sparse_step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    if getattr(cfg, "mlp_only_layers", None) or sparse_step != 1:
        raise ValueError(
            "qwen3_moe with dense layers among the MoE ones (mlp_only_layers / decoder_sparse_step != 1) is not "
            "converted by the megatron backend; use --train-backend fsdp for this model"
        )
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        raise ValueError("MoE with shared experts is not converted by the megatron backend; use --train-backend fsdp")
    return {
        "num_experts": int(cfg.num_experts),
        "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
        "moe_topk": int(cfg.num_experts_per_tok),
        "norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", True)),
    }


def per_expert_view(hf: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`hf` itself, or (when it holds fused expert tensors) a dict with every expert under its own names."""
    if not any(FUSED_EXPERTS.match(n) for n in hf):
        return hf
    return dict(split_fused_experts(hf.items()))


def moe_layer_names(
    num_experts: int, local: int, layer: int, ep_rank: int, ep_size: int
) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name, HF names) of the router and this EP rank's experts of global layer `layer`,
    stored as the stage's local layer `local`."""
    m, h = f"decoder.layers.{local}.mlp", f"model.layers.{layer}.mlp"
    out = [(f"{m}.router.weight", (f"{h}.gate.weight",))]
    per_rank = num_experts // ep_size
    for i in range(per_rank):
        e = ep_rank * per_rank + i
        hx = f"{h}.experts.{e}"
        out.append(
            (f"{m}.experts.local_experts.{i}.linear_fc1.weight", (f"{hx}.gate_proj.weight", f"{hx}.up_proj.weight"))
        )
        out.append((f"{m}.experts.local_experts.{i}.linear_fc2.weight", (f"{hx}.down_proj.weight",)))
    return out


def moe_export_names(num_experts: int, local: int, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name, HF names) of one MoE layer as exported: the router, then the two expert stacks."""
    m, h = f"decoder.layers.{local}.mlp", f"model.layers.{layer}.mlp"
    experts = range(num_experts)
    fc1 = tuple(f"{h}.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up"))
    fc2 = tuple(f"{h}.experts.{e}.down_proj.weight" for e in experts)
    return [
        (f"{m}.router.weight", (f"{h}.gate.weight",)),
        (f"{m}.experts.linear_fc1.weight", fc1),
        (f"{m}.experts.linear_fc2.weight", fc2),
    ]


def local_expert_names(stack_name: str, num_local: int) -> list[str]:
    """The Megatron names of the local experts' tensors a stack name stands for, in local order."""
    m = STACK.match(stack_name)
    return [f"{m['prefix']}.local_experts.{i}.{m['which']}.weight" for i in range(num_local)]


def expert_kind(mname: str) -> str | None:
    """'expert_fc1' / 'expert_cols' for expert tensors (local or stacked), None for anything else."""
    if LOCAL_EXPERT not in mname and not STACK.match(mname):
        return None
    return "expert_fc1" if mname.endswith("linear_fc1.weight") else "expert_cols"


def expert_shard(kind: str, parts: list[torch.Tensor], etp_rank: int, etp_size: int) -> torch.Tensor:
    """One local expert's tensor on expert-TP rank `etp_rank` from its full HF matrices."""
    if kind == "expert_fc1":
        gate, up = parts
        return torch.cat([gate.chunk(etp_size, dim=0)[etp_rank], up.chunk(etp_size, dim=0)[etp_rank]]).clone()
    return parts[0].chunk(etp_size, dim=1)[etp_rank].clone()


def gather_expert_tp(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Every expert-TP rank's stacked [L, rows, cols] shards -> the full stack [L, rows, cols]."""
    if len(shards) == 1:
        return shards[0]
    if kind == "expert_fc1":
        gates, ups = zip(*(t.chunk(2, dim=1) for t in shards), strict=True)
        return torch.cat([*gates, *ups], dim=1)
    return torch.cat(shards, dim=2)


def stack_to_hf(kind: str, full: torch.Tensor, hnames: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF per-expert (name, tensor) pairs of a full expert stack [E, ...] (views, no copy)."""
    if kind == "expert_fc1":
        halves = [half for e in range(full.shape[0]) for half in full[e].chunk(2, dim=0)]
        yield from zip(hnames, halves, strict=True)
    else:
        yield from zip(hnames, full.unbind(0), strict=True)


def hf_moe_shape(suffix: str, num_experts: int, hidden: int, moe_ffn: int) -> tuple[int, ...] | None:
    """The shape of a layer-relative HF MoE tensor name, None for a name that is not one."""
    if suffix == "mlp.gate.weight":
        return (num_experts, hidden)
    if not _HF_EXPERT.match(suffix):
        return None
    return (hidden, moe_ffn) if suffix.endswith("down_proj.weight") else (moe_ffn, hidden)
