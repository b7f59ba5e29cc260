"""megatron-core GPTModel for a HF dense decoder, fed packed sequences.

The layer spec is megatron-core's local one (its own ColumnParallelLinear / RowParallelLinear)
with torch's RMSNorm (`RMSNorm`, `HeadRMSNorm`) and the core attention replaced by `PackedCoreAttention`: every micro-batch is one
row of concatenated sequences in Megatron's THD layout (`PackedSeqParams(qkv_format="thd")`), so
RoPE restarts at every sequence (megatron-core applies it per `cu_seqlens`) and attention runs causal
within each sequence, one SDPA call per sequence (flash kernels on GPU, in bf16). Transformer
Engine is not needed.

Only the positions that predict a response token go through the output layer (`response_logits`,
given to GPTModel as its output processor), gathered over tensor-parallel ranks to the full
vocabulary; log-probs and entropy then come from `forward.log_probs_and_entropy`, as in FSDP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from miles.trainer.mcore_convert import ModelShape, padded_vocab_size


def transformer_config(
    s: ModelShape,
    *,
    tp: int,
    pp: int,
    cp: int,
    sequence_parallel: bool,
    compute_dtype: torch.dtype,
    on_gpu: bool,
    recompute: bool,
) -> TransformerConfig:
    """Megatron's config for the HF shape; fused kernels that need Apex / TE stay off."""
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
        params_dtype=compute_dtype,
        pipeline_dtype=compute_dtype,
        bf16=compute_dtype == torch.bfloat16,
        fp16=compute_dtype == torch.float16,
        variable_seq_lengths=True,  # packed micro-batches differ in length; stages exchange shapes
        moe_token_dispatcher_type="alltoall",  # dense models: only the check of variable lengths reads it
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
    )


class PackedCoreAttention(MegatronModule):
    """Causal attention within each sequence of a THD-packed row (GQA through SDPA's enable_gqa)."""

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
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

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
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedCoreAttention needs THD-packed inputs (PackedSeqParams(qkv_format='thd'))")
        cu = packed_seq_params.cu_seqlens_q
        lengths = (cu[1:] - cu[:-1]).tolist()
        outs = []
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
            outs.append(o.squeeze(0).transpose(0, 1).flatten(1))
        return torch.cat(outs)


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
    attn.core_attention = PackedCoreAttention
    if s.qk_norm:
        attn.q_layernorm = attn.k_layernorm = HeadRMSNorm
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
        position_embedding_type="rope",
        rotary_base=s.rope_theta,
    )


def packed_seq_params(seq_lens: list[int], device: torch.device) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(seq_lens)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
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
