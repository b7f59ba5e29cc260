"""The embedded engine's forward with the Triton kernels (triton_ops.py): one decode token per slot
(`decode_fused`) and a prefill that returns each row's last hidden state (`prefill_fused`). Dense models
only; the runner calls these where `fused_kernels` is on, the eager `CausalLM.forward` (model.py) elsewhere.

Both read the model's weights, RoPE table and layer names (`CausalLM.storage`, `rope_table_covering`,
`layer_names`) and compute what the eager forward computes, up to the kernels' rounding: the residual stream
stays in fp32 in a bf16 model (`fp32_residual`, model.py's module doc says why), every GEMM reads
model-dtype inputs, or e4m3 codes where an FP8 GEMM takes its input quantized (`_fused_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engines.embedded import fp8, triton_ops
from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.layer_ops import linear
from miles.engines.embedded.model import CausalLM


def decode_fused(
    model: CausalLM,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    lens: torch.Tensor,
    kv: KVCache,
    attention: triton_ops.DecodeAttention,
) -> torch.Tensor:
    """One decode token for each of the slots 0..B-1 with the Triton kernels (see triton_ops).

    tokens, positions [B] (the token's position; its K/V are written there), lens [B] (keys each row
    attends to: position + 1). Returns the final-normed hidden [B, D]. Dense models only.
    """
    s, st = model.spec, model.storage
    eps = s.rms_norm_eps
    B, H = tokens.shape[0], s.num_heads
    table = model.rope_table_covering(kv.k.shape[3])
    h = F.embedding(tokens, st["model.embed_tokens.weight"])  # the residual stream, updated in place
    if model.fp32_residual:
        h = h.float()
    x = _fused_norm(model, h, None, *_norm_before(model, 0))
    for i, names in enumerate(model.layer_names):
        w_qkv, bias = st[names["qkv"]], st.get(names["qkv_b"])
        # an FP8 GEMM has no bias epilogue: the attention kernel adds the bias, rounding as `qkv + bias` would
        in_attention = bias is not None and isinstance(w_qkv, fp8.Fp8Weight)
        qkv = linear(x, w_qkv, None if in_attention else bias)
        attn = attention.rope_attend(
            qkv, positions, lens, table, kv.k[i], kv.v[i], st.get(names["qn"]), st.get(names["kn"]), eps,
            bias=bias if in_attention else None,
        ).view(B, H * s.head_dim)  # fmt: skip
        x = _fused_norm(model, linear(attn, st[names["o"]], st.get(names["ob"])), h, names["ln2"], names["gate_up"])
        x = _fused_norm(model, _fused_mlp(model, names, x), h, *_norm_before(model, i + 1))
    return x


def prefill_fused(
    model: CausalLM,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    last_idx: torch.Tensor,
    kv: KVCache,
    slot_start: int,
    attention: triton_ops.DecodeAttention,
    extend_len: int | None = None,
) -> torch.Tensor:
    """`forward(..., kv_len=None, out_index=last_idx, extend_len=extend_len)` with the Triton kernels: prefill
    tokens [B, T] into slots [slot_start, slot_start + B) and return the final-normed hidden of token
    last_idx[b] of each row, [B, D]. Dense models only.

    Norms, residual adds, RoPE + the KV write and SiLU*up are the decode step's kernels over all B x T
    tokens. From position 0 (extend_len None) attention is SDPA's causal kernel over the fresh keys (padded
    keys stay in the batch, so the cache's stale tail is never read). With extend_len (a prefix cache hit:
    the slots hold K/V before each row's first position) every token attends over its slot's cache up to its
    own position, as the eager extend does: the keys are written first, then read back with the cache's
    rounding. The last layer attends from the B selected tokens alone, over the cache up to their positions
    (the decode attention kernel), and runs its output projection and MLP for those B tokens.
    """
    s, st = model.spec, model.storage
    eps = s.rms_norm_eps
    B, T = tokens.shape
    H, KVH, hd = s.num_heads, s.num_kv_heads, s.head_dim
    n = B * T
    table = model.rope_table_covering(kv.k.shape[3])
    rows = model.arange(B)
    slots = (slot_start + rows).repeat_interleave(T)  # dense: one slot per token, B = 1 included
    select = rows * T + last_idx
    pos, wpos = positions.reshape(-1), write_pos.reshape(-1)
    extend = extend_len is not None
    keys = None if extend else torch.empty((n, KVH, hd), dtype=model.dtype, device=model.device)
    keep = model.extend_mask(positions, extend_len) if extend else None
    last_lens = positions[rows, last_idx] + 1  # the selected tokens attend to the cache up to themselves
    h = F.embedding(tokens.reshape(-1), st["model.embed_tokens.weight"])
    if model.fp32_residual:
        h = h.float()
    x = _fused_norm(model, h, None, *_norm_before(model, 0))
    for i, names in enumerate(model.layer_names):
        last = i + 1 == s.num_layers
        qkv = linear(x, st[names["qkv"]], st.get(names["qkv_b"]))
        q = triton_ops.rope_kv_write(
            qkv, pos, slots, table, kv.k[i], kv.v[i], H, KVH, st.get(names["qn"]), st.get(names["kn"]), eps,
            write_positions=wpos, k_out=None if last or extend else keys,
        )  # fmt: skip
        if last:
            k_cache, v_cache = kv.k[i][slot_start:], kv.v[i][slot_start:]
            attn = attention(q[select], k_cache, v_cache, last_lens).view(B, H * hd)
            h = h[select]
        elif extend:
            cached_k, cached_v = kv.read(i, slot_start, B, extend_len)
            q_heads = q.view(B, T, H, hd).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q_heads, cached_k, cached_v, attn_mask=keep, enable_gqa=H != KVH)
            attn = attn.transpose(1, 2).reshape(n, H * hd)
        else:
            values = qkv.view(B, T, H + 2 * KVH, hd)[:, :, H + KVH :]
            attn = F.scaled_dot_product_attention(
                q.view(B, T, H, hd).transpose(1, 2),
                keys.view(B, T, KVH, hd).transpose(1, 2),
                values.transpose(1, 2),
                is_causal=True,
                enable_gqa=H != KVH,
            )
            attn = attn.transpose(1, 2).reshape(n, H * hd)
        x = _fused_norm(model, linear(attn, st[names["o"]], st.get(names["ob"])), h, names["ln2"], names["gate_up"])
        x = _fused_norm(model, _fused_mlp(model, names, x), h, *_norm_before(model, i + 1))
    return x


# The fused paths' norms and SiLU hand an FP8 GEMM on cuBLASLt (or Triton's) its input already quantized
# (fp8.QuantizedInput: the codes the GEMM's own quantization would give, one launch fewer per GEMM); everywhere else
# model dtype.
def _fused_norm(
    model: CausalLM, x: torch.Tensor, residual: torch.Tensor | None, norm: str, feeds: str | None
) -> torch.Tensor | fp8.QuantizedInput:
    """triton_ops.add_rms_norm by the norm weight named `norm`, quantized for the weight named `feeds` (the
    GEMM its output goes to) where that GEMM takes it so (fp8.takes_quantized_input)."""
    quantize = feeds is not None and fp8.takes_quantized_input(model.storage[feeds])
    return triton_ops.add_rms_norm(x, residual, model.storage[norm], model.spec.rms_norm_eps, quantize=quantize)


def _norm_before(model: CausalLM, layer: int) -> tuple[str, str | None]:
    """(the norm before `layer`'s attention, the weight its output feeds); past the last layer the final norm,
    which feeds the LM head (in the model dtype)."""
    if layer == model.spec.num_layers:
        return "model.norm.weight", None
    return model.layer_names[layer]["ln1"], model.layer_names[layer]["qkv"]


def _fused_mlp(model: CausalLM, names: dict[str, str], x: torch.Tensor | fp8.QuantizedInput) -> torch.Tensor:
    """The dense MLP of normed x: gate/up GEMM, SiLU * up (quantized for the down GEMM where it takes that), down."""
    down = model.storage[names["down"]]
    gate_up = linear(x, model.storage[names["gate_up"]])
    return linear(triton_ops.silu_mul(gate_up, quantize=fp8.takes_quantized_input(down)), down)
