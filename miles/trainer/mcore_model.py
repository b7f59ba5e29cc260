"""megatron-core GPTModel for a HF decoder (dense, or Qwen3-MoE through `mcore_moe`), fed packed sequences.

The layer spec is megatron-core's local one (its own ColumnParallelLinear / RowParallelLinear)
with torch's RMSNorm (`RMSNorm`, `HeadRMSNorm`) and the core attention replaced by
`PackedCoreAttention`. Every micro-batch is one row of concatenated sequences in Megatron's THD
layout, described by `PackedRows` (a `PackedSeqParams(qkv_format="thd")` that also carries each
token's position and how the sequences group for attention, all built once per micro-batch on the
host). The core attention applies RoPE itself (GPTModel is built without a position embedding:
megatron-core's THD RoPE loops over the sequences in Python, with a host sync per layer) and runs
causal attention within each sequence as a few SDPA calls over right-padded [n, L] groups of
similar length (flash kernels on GPU). Transformer Engine is not needed.

Parameters are fp32 (the checkpoint's values, as in the FSDP backend); the compute dtype applies
through autocast in the backend's forward step.

Only the positions that predict a response token go through the output layer (`response_logits`,
given to GPTModel as its output processor), gathered over tensor-parallel ranks to the full
vocabulary; log-probs and entropy then come from `forward.log_probs_and_entropy`, as in FSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from miles.trainer.mcore_convert import ModelShape, padded_vocab_size
from miles.trainer.mcore_moe import moe_config_fields, moe_mlp_spec


def transformer_config(
    s: ModelShape,
    *,
    tp: int,
    pp: int,
    cp: int,
    sequence_parallel: bool,
    on_gpu: bool,
    recompute: bool,
    ep: int = 1,
    etp: int = 1,
) -> TransformerConfig:
    """Megatron's config for the HF shape (`ep` / `etp`: expert-parallel and expert-tensor-parallel sizes of
    an MoE model); fused kernels that need Apex / TE stay off."""
    return TransformerConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads,
        kv_channels=s.head_dim,
        ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=s.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.float32,  # fp32 parameters; bf16 compute comes from autocast
        pipeline_dtype=torch.float32,  # the residual stream stays fp32 under autocast
        bf16=False,
        fp16=False,
        variable_seq_lengths=True,  # packed micro-batches differ in length; stages exchange shapes
        moe_token_dispatcher_type="alltoall",  # the only dispatcher for variable lengths; dense: only checked
        calculate_per_token_loss=True,  # losses arrive divided by step-wide denominators: no 1/num_microbatches
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe_config_fields(s, ep=ep, etp=etp),
    )


# Sequences of a micro-batch share one SDPA call when padding them to the longest of the call
# costs at most this factor in attention positions (sorted by length, grouped greedily).
PAD_WASTE = 1.5


@dataclass
class SdpaGroup:
    """One SDPA call: `n` sequences right-padded to `width` tokens.

    `gather` [n * width]: the packed-row index of each padded slot (padding reads token 0); None when
    the group is the contiguous block of the packed row from `start` (equal lengths, in order), read
    as a view. `keep`: the real slots among the n * width; None when nothing is padding.
    """

    n: int
    width: int
    start: int
    gather: torch.Tensor | None
    keep: torch.Tensor | None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """[t, heads, d] packed -> [n, heads, width, d]."""
        rows = (
            x[self.start : self.start + self.n * self.width] if self.gather is None else x.index_select(0, self.gather)
        )
        return rows.view(self.n, self.width, *x.shape[1:]).transpose(1, 2)

    def put(self, o: torch.Tensor) -> torch.Tensor:
        """[n, heads, width, d] -> [real tokens, heads * d]; right padding: real queries never saw it."""
        flat = o.transpose(1, 2).reshape(self.n * self.width, -1)
        return flat if self.keep is None else flat.index_select(0, self.keep)


@dataclass
class PackedRows(PackedSeqParams):
    """THD packing of one micro-batch, with what the core attention needs precomputed on the host.

    `positions` [t]: each token's position within its sequence (RoPE). `groups`: the SDPA calls.
    `inverse` [t]: where each packed token sits in the concatenation of the groups' outputs; None
    when that concatenation is already in packed order. `cache`: per-dtype cos/sin, filled by the
    first layer. Every index is an integer tensor made once on the host: no layer syncs with it.
    """

    positions: torch.Tensor | None = None
    groups: list[SdpaGroup] = field(default_factory=list)
    inverse: torch.Tensor | None = None
    cache: dict = field(default_factory=dict)


def group_by_length(seq_lens: list[int], waste: float = PAD_WASTE) -> list[list[int]]:
    """Sequence indices in groups (longest first) whose padded size stays within `waste` x their tokens."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    tokens = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] <= waste * (tokens + seq_lens[i]):
            groups[-1].append(i)
            tokens += seq_lens[i]
        else:
            groups.append([i])
            tokens = seq_lens[i]
    return groups


def packed_seq_params(seq_lens: list[int], device: torch.device) -> PackedRows:
    lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    positions = np.concatenate([np.arange(n) for n in lens])

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    groups, order = [], []
    for g in group_by_length([int(n) for n in lens]):
        width = int(lens[g[0]])
        cols = np.arange(width)
        valid = cols[None, :] < lens[g][:, None]
        index = np.where(valid, starts[g][:, None] + cols[None, :], 0)
        order.append(index[valid])
        start = int(starts[g[0]])
        contiguous = bool(valid.all()) and np.array_equal(index.reshape(-1), np.arange(start, start + index.size))
        groups.append(
            SdpaGroup(
                n=len(g),
                width=width,
                start=start,
                gather=None if contiguous else on_device(index.reshape(-1)),
                keep=None if valid.all() else on_device(np.flatnonzero(valid)),
            )
        )
    packed_order = np.concatenate(order)
    in_order = np.array_equal(packed_order, np.arange(len(packed_order)))
    inverse = np.empty(len(packed_order), dtype=np.int64)
    inverse[packed_order] = np.arange(len(inverse))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).to(device)
    longest = int(lens.max())
    return PackedRows(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        positions=on_device(positions),
        groups=groups,
        inverse=None if in_order else on_device(inverse),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PackedCoreAttention(MegatronModule):
    """RoPE, then causal attention within each sequence of a THD-packed row (GQA through SDPA's enable_gqa)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        d = config.kv_channels
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # as HF

    def _cos_sin(self, rows: PackedRows, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in rows.cache:  # once per micro-batch: every layer shares it
            inv = self.inv_freq.to(rows.positions.device)
            freqs = rows.positions.float()[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [t, 1, d]
            rows.cache[dtype] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return rows.cache[dtype]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """query [t, heads, d], key/value [t, kv_heads, d] -> [t, heads * d]."""
        if not isinstance(packed_seq_params, PackedRows):
            raise ValueError("PackedCoreAttention needs the micro-batch's PackedRows (mcore_model.packed_seq_params)")
        rows = packed_seq_params
        cos, sin = self._cos_sin(rows, query.dtype)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos.to(key.dtype) + _rotate_half(key) * sin.to(key.dtype)
        outs = []
        for g in rows.groups:
            q, k, v = (g.take(x) for x in (query, key, value))  # [n, heads, L, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
            outs.append(g.put(o))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if rows.inverse is None else out.index_select(0, rows.inverse)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm under Megatron's norm constructor. Under sequence parallelism each rank
    normalises its slice of the tokens, so the weight is marked for the all-reduce of its gradient
    over tensor-parallel ranks (megatron-core's own torch norm refuses sequence parallelism)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(torch.nn.RMSNorm):
    """Qwen3's per-head q/k norm: sees every token; megatron-core all-reduces its gradient by name."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


def block_spec(s: ModelShape, num_stage_layers: int) -> TransformerBlockSubmodules:
    layer = get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm")
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    attn = layer.submodules.self_attention.submodules
    attn.core_attention = ModuleSpec(module=PackedCoreAttention, params={"rope_theta": s.rope_theta})
    if s.qk_norm:
        attn.q_layernorm = attn.k_layernorm = HeadRMSNorm
    if s.num_experts:
        layer.submodules.mlp = moe_mlp_spec(s.norm_topk_prob)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_stage_layers, layer_norm=RMSNorm)


def build_gpt_model(
    s: ModelShape, config: TransformerConfig, *, num_stage_layers: int, pre: bool, post: bool
) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(s, num_stage_layers),
        vocab_size=padded_vocab_size(s.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=s.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=s.tied_embeddings,
        position_embedding_type="none",  # RoPE is applied in PackedCoreAttention
    )


def response_logits(
    *,
    hidden_states: torch.Tensor,
    output_layer,
    output_weight: torch.Tensor | None,
    context: dict,
    config: TransformerConfig,
    **_unused,
) -> torch.Tensor:
    """GPTModel output processor: logits [n, vocab] at `context["logits_index"]` (positions of the
    packed row), full vocabulary on every tensor-parallel rank, padding rows of the vocabulary dropped.

    Gradients flow back as through Megatron's own output layer: the sequence-parallel gather
    reduce-scatters, the tensor-parallel copy all-reduces, the vocabulary gather splits.
    """
    h = hidden_states
    if config.sequence_parallel:
        h = tensor_parallel.gather_from_sequence_parallel_region(h)
    h = h.squeeze(1)[context["logits_index"]]
    if not config.sequence_parallel:
        h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
    weight = output_weight if output_weight is not None else output_layer.weight
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(F.linear(h, weight))
    return logits[:, : context["vocab_size"]]
