"""HF <-> megatron-core GPTModel weights for Llama / Qwen2 / Qwen3 and Qwen3-MoE models, in plain torch.

Megatron's layout differs from HF's in three places:
- `linear_qkv` fuses q, k and v, grouped by KV head: for each of the `num_kv_heads` groups, that
  group's `num_heads / num_kv_heads` query heads, then its key head, then its value head (rows of
  `head_dim` each). Qwen2's q/k/v biases fuse the same way.
- `linear_fc1` fuses gate and up. Under tensor parallelism each rank holds [gate shard; up shard],
  so the shard of rank r is cat(gate[r], up[r]), not rows r of cat(gate, up).
- With tied embeddings and one pipeline stage there is no `output_layer.weight`; with several
  stages the last one holds its own copy of the embedding (Megatron keeps the two in sync).

Column-parallel weights (qkv, fc1, embedding, output layer) split along rows, row-parallel ones
(linear_proj, fc2) along columns; norms are whole on every rank. The vocabulary is padded with
zero rows to a multiple of the tensor-parallel size (`padded_vocab_size`); the export drops them.
Everything here works on one tensor-parallel rank's shard (`to_mcore`) or on all ranks' shards of
one tensor (`gather_shards`), so the backend and the tests use the same code. The MoE layers'
router and experts (expert-parallel and expert-tensor-parallel shards) are in `mcore_moe_convert`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from miles.trainer import mcore_moe_convert as moe
from miles.trainer.moe_layout import check_expert_parallel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the conversion and the GPTModel build need of a HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int = 0  # 0: a dense model; else every layer's MLP is an MoE layer (mcore_moe_convert)
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"rope type {rope_type!r} of the HF config is not supported by the megatron backend (plain RoPE only); "
            "use --train-backend fsdp for this model"
        )
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has no rope_theta; cannot build the megatron model")
    return float(theta)


def model_shape(cfg) -> ModelShape:
    """The shape of a HF config, refusing what the megatron backend does not convert."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r}: the megatron backend converts {', '.join(SUPPORTED_MODEL_TYPES)} "
            "models; use --train-backend fsdp for this one"
        )
    if getattr(cfg, "mlp_bias", False) or (model_type == "llama" and getattr(cfg, "attention_bias", False)):
        raise ValueError(f"{model_type} with attention_bias/mlp_bias is not converted; use --train-backend fsdp")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron backend; use --train-backend fsdp")
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelShape(
        model_type=model_type,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        ffn_hidden_size=int(cfg.intermediate_size),
        vocab_size=int(cfg.vocab_size),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        norm_eps=float(cfg.rms_norm_eps),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.max_position_embeddings),
        **(moe.moe_fields(cfg) if model_type == "qwen3_moe" else {}),
    )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layer indices of pipeline stage `pp_rank` (equal split, as Megatron's default)."""
    if num_layers % pp_size:
        raise ValueError(
            f"--pipeline-model-parallel-size={pp_size} does not divide the model's {num_layers} layers; "
            f"pick a divisor of {num_layers}"
        )
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


# ---- one tensor's shard on one tensor-parallel rank --------------------------------------------------


def _rows(t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=0)[tp_rank].clone()


def _cols(t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=1)[tp_rank].clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights [heads*d, hidden] or biases [heads*d]) -> Megatron's group-interleaved qkv."""
    per_group = s.num_heads // s.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(s.num_kv_heads, per_group * s.head_dim, *tail)
    k = k.reshape(s.num_kv_heads, s.head_dim, *tail)
    v = v.reshape(s.num_kv_heads, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` on the full (all tensor-parallel ranks') tensor."""
    per_group = s.num_heads // s.num_kv_heads
    tail = qkv.shape[1:]
    grouped = qkv.reshape(s.num_kv_heads, (per_group + 2) * s.head_dim, *tail)
    q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# ---- names -----------------------------------------------------------------------------------------


def _layer_map(s: ModelShape, fused_norms: bool) -> dict[str, tuple[str, ...]]:
    """Megatron layer-relative name -> the HF layer-relative names it is made of."""
    m = {
        "self_attention.linear_qkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    }
    if not s.num_experts:  # an MoE layer's router and experts: mcore_moe_convert
        m["mlp.linear_fc1.weight"] = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
        m["mlp.linear_fc2.weight"] = ("mlp.down_proj.weight",)
    if fused_norms:  # Transformer Engine's LayerNormLinear holds the norm before the linear
        m["self_attention.linear_qkv.layer_norm_weight"] = ("input_layernorm.weight",)
        m["mlp.linear_fc1.layer_norm_weight"] = ("post_attention_layernorm.weight",)
    else:
        m["input_layernorm.weight"] = ("input_layernorm.weight",)
        m["pre_mlp_layernorm.weight"] = ("post_attention_layernorm.weight",)
    if s.qkv_bias:
        m["self_attention.linear_qkv.bias"] = tuple(f"self_attn.{p}_proj.bias" for p in "qkv")
    if s.qk_norm:
        m["self_attention.q_layernorm.weight"] = ("self_attn.q_norm.weight",)
        m["self_attention.k_layernorm.weight"] = ("self_attn.k_norm.weight",)
    return m


def stage_names(
    s: ModelShape,
    layers: range,
    *,
    pre: bool,
    post: bool,
    fused_norms: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    export: bool = False,
) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name on this stage, HF names it is made of) for every parameter of one pipeline stage
    (and, for MoE, of expert-parallel rank `ep_rank`), in HF order (embedding, layers, final norm, head).
    `export`: every MoE layer's experts as two stacks of all experts (what `hf_export_names` walks)."""
    out: list[tuple[str, tuple[str, ...]]] = []
    if pre:
        out.append(("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)))
    per_layer = _layer_map(s, fused_norms)
    for local, i in enumerate(layers):
        for mname, hnames in per_layer.items():
            out.append((f"decoder.layers.{local}.{mname}", tuple(f"model.layers.{i}.{h}" for h in hnames)))
        if s.num_experts and export:
            out.extend(moe.moe_export_names(s.num_experts, local, i))
        elif s.num_experts:
            out.extend(moe.moe_layer_names(s.num_experts, local, i, ep_rank, ep_size))
    if post:
        out.append(("decoder.final_layernorm.weight", ("model.norm.weight",)))
        if not s.tied_embeddings:
            out.append(("output_layer.weight", ("lm_head.weight",)))
        elif not pre:  # the last stage's copy of the tied embedding
            out.append(("output_layer.weight", ("model.embed_tokens.weight",)))
    return out


def parallel_kind(mname: str) -> str:
    expert = moe.expert_kind(mname)
    if expert is not None:
        return expert
    if mname.endswith("linear_qkv.weight") or mname.endswith("linear_qkv.bias"):
        return "qkv"
    if mname.endswith("linear_fc1.weight"):
        return "fc1"
    if mname.endswith("linear_proj.weight") or mname.endswith("linear_fc2.weight"):
        return "cols"
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    return "whole"


# ---- HF -> Megatron ----------------------------------------------------------------------------------


def to_mcore(
    hf: Mapping[str, torch.Tensor],
    s: ModelShape,
    *,
    layers: range,
    pre: bool,
    post: bool,
    tp_rank: int = 0,
    tp_size: int = 1,
    fused_norms: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """This (pipeline stage, tensor-parallel rank, expert-parallel rank, expert-TP rank)'s Megatron parameters
    from full HF tensors (experts in either HF naming)."""
    if s.num_kv_heads % tp_size:
        raise ValueError(f"--tensor-model-parallel-size={tp_size} must divide the model's {s.num_kv_heads} KV heads")
    if s.num_experts:
        check_expert_parallel(s.num_experts, ep_size, s.moe_ffn_hidden_size, etp_size)
        hf = moe.per_expert_view(hf)
    out = {}
    names = stage_names(s, layers, pre=pre, post=post, fused_norms=fused_norms, ep_rank=ep_rank, ep_size=ep_size)
    for mname, hnames in names:
        parts = [hf[h] for h in hnames]
        kind = parallel_kind(mname)
        if kind.startswith("expert"):
            out[mname] = moe.expert_shard(kind, parts, etp_rank, etp_size)
        elif kind == "qkv":
            out[mname] = _rows(fuse_qkv(*parts, s), tp_rank, tp_size)
        elif kind == "fc1":
            gate, up = parts
            out[mname] = torch.cat([_rows(gate, tp_rank, tp_size), _rows(up, tp_rank, tp_size)])
        elif kind == "cols":
            out[mname] = _cols(parts[0], tp_rank, tp_size)
        elif kind == "vocab":
            out[mname] = _rows(_pad_rows(parts[0], padded_vocab_size(s.vocab_size, tp_size)), tp_rank, tp_size)
        else:
            out[mname] = parts[0].clone()
    return out


# ---- Megatron -> HF ----------------------------------------------------------------------------------


def gather_shards(mname: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full (tensor-parallel size 1) Megatron tensor from every tensor-parallel rank's shard."""
    kind = parallel_kind(mname)
    if kind == "whole" or len(shards) == 1:
        return shards[0]
    if kind.startswith("expert"):  # stacked local experts [L, rows, cols] of every expert-TP rank
        return moe.gather_expert_tp(kind, shards)
    if kind == "fc1":
        gates, ups = zip(*(t.chunk(2, dim=0) for t in shards), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim=1 if kind == "cols" else 0)


def to_hf(
    mname: str, full: torch.Tensor, hnames: tuple[str, ...], s: ModelShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one full Megatron tensor."""
    kind = parallel_kind(mname)
    if kind.startswith("expert"):
        yield from moe.stack_to_hf(kind, full, hnames)
    elif kind == "qkv":
        yield from zip(hnames, split_qkv(full, s), strict=True)
    elif kind == "fc1":
        yield from zip(hnames, full.chunk(2, dim=0), strict=True)
    elif kind == "vocab":
        yield hnames[0], full[: s.vocab_size]
    else:
        yield hnames[0], full


def hf_export_names(s: ModelShape, pp_size: int, fused_norms: bool = False) -> list[tuple[int, str, tuple[str, ...]]]:
    """(pipeline stage, Megatron name, HF names) of every exported tensor, stage by stage: the order
    every rank walks in `named_hf_tensors`. The last stage's copy of a tied embedding is not exported."""
    out = []
    for pp_rank in range(pp_size):
        layers = stage_layers(s.num_layers, pp_size, pp_rank)
        pre, post = pp_rank == 0, pp_rank == pp_size - 1
        for mname, hnames in stage_names(s, layers, pre=pre, post=post, fused_norms=fused_norms, export=True):
            if mname == "output_layer.weight" and s.tied_embeddings:
                continue
            out.append((pp_rank, mname, hnames))
    return out


def hf_shape(hname: str, s: ModelShape) -> tuple[int, ...]:
    """The shape of HF tensor `hname`, known on every rank without the tensor (pipeline broadcasts)."""
    h, d, f = s.hidden_size, s.head_dim, s.ffn_hidden_size
    suffix = hname.split(".", 3)[-1] if hname.startswith("model.layers.") else hname
    expert = moe.hf_moe_shape(suffix, s.num_experts, h, s.moe_ffn_hidden_size)
    if expert is not None:
        return expert
    shapes = {
        "model.embed_tokens.weight": (s.vocab_size, h),
        "lm_head.weight": (s.vocab_size, h),
        "model.norm.weight": (h,),
        "self_attn.q_proj.weight": (s.num_heads * d, h),
        "self_attn.k_proj.weight": (s.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (s.num_kv_heads * d, h),
        "self_attn.q_proj.bias": (s.num_heads * d,),
        "self_attn.k_proj.bias": (s.num_kv_heads * d,),
        "self_attn.v_proj.bias": (s.num_kv_heads * d,),
        "self_attn.o_proj.weight": (h, s.num_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    return shapes[suffix]
