"""Batched decoder-only transformer forward for the embedded engine, over HF-named tensors.

Families: qwen2, llama, qwen3 (q/k-norm), qwen3_moe (top-k routed SwiGLU experts). The math follows
the HF implementations op for op in fp32 (RMSNorm in fp32, RoPE tables in fp32, softmax in fp32) so
that greedy outputs and log-probs agree with `transformers` on CPU.

Parameters live in a flat dict keyed by their HF checkpoint names, which is what weight updates
address (`load_weights`) and what `named_weights` returns: no module tree to keep in sync. Reading the
checkpoint is checkpoint.py's; the eager norm and linear ops are layer_ops.py's; the forward with the Triton
kernels (`decode_fused`, `prefill_fused`) is fused_forward.py's.

In a bf16 (or fp16) model every forward (eager, and the fused `decode_fused` / `prefill_fused`) keeps the
residual stream in fp32: the layers' sums are never rounded, not twice per layer, while every GEMM still
reads model-dtype inputs (the norms round their outputs). Over 24 MoE layers a bf16 stream was about half of
what stayed between the engine's log-probs and an fp32 trainer's once routing was replayed (CPU trial,
bench/results/moe.md). `fp32_residual = False` puts the stream back in the model dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from miles.engines.embedded import fp8, moe
from miles.engines.embedded.checkpoint import (
    FUSED_PARTS,
    ModelSpec,
    check_params,
    iter_safetensors,
    layer_names,
    read_config,
)
from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.layer_ops import linear, linear_residual, rms_norm

logger = logging.getLogger(__name__)


class CausalLM:
    """Weights + forward. Not an nn.Module: parameters are plain tensors keyed by HF name.

    q/k/v (and their biases) and gate/up are stored fused, one matmul each; a MoE layer's experts are
    stored as transformers 5 holds them, `mlp.experts.gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]
    (loaded from either naming, see miles/utils/moe_names.py). `params` maps every HF checkpoint name
    (per-expert names for experts) to a view into that storage, so copying into `params[name]` updates
    the fused tensor; `weight_target` also resolves the fused expert names.
    """

    def __init__(self, spec: ModelSpec, params: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.fp32_residual = dtype != torch.float32  # the residual stream's dtype (see the module doc)
        check_params(spec, params)
        self.layer_names = [layer_names(i) for i in range(spec.num_layers)]
        self.storage: dict[str, torch.Tensor] = {}
        self._views: dict[str, tuple[str, tuple] | None] = {}  # HF name -> (storage key, index) or whole
        self._fuse(params)
        self.params: dict[str, torch.Tensor] = {}
        self.rebuild_views()
        inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim)
        )
        self.inv_freq = inv_freq.to(device)
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated): negation is exact
        half = spec.head_dim // 2
        self._rope_sign = torch.cat((-torch.ones(half), torch.ones(half))).to(device=device)
        self._rope_table: torch.Tensor | None = None  # [P, 2 * head_dim]: cos | signed sin of positions < P
        self._rope_table_len = min(spec.max_position_embeddings, 32768)
        self._aranges: torch.Tensor | None = None
        self._mask_fill: tuple[torch.Tensor, torch.Tensor] | None = None
        # decode attention as baddbmm/softmax/bmm (CPU fp32) instead of SDPA (see _decode_attention)
        self._bmm_attention = device.type == "cpu" and dtype == torch.float32
        self.moe_impl = "grouped"  # "loop": the per-expert reference loop (benchmarks compare the two)

    @classmethod
    def from_pretrained(cls, model_path: str, device: torch.device, dtype: torch.dtype) -> CausalLM:
        spec = ModelSpec.from_config(read_config(model_path))
        params = {
            name: t.to(device=device, dtype=dtype)
            for name, t in iter_safetensors(model_path)
            if name != "lm_head.weight" or not spec.tie_word_embeddings
        }
        return cls(spec, params, device, dtype)

    # ---- parameter bookkeeping -------------------------------------------------------------------
    def _fuse(self, params: dict[str, torch.Tensor]) -> None:
        params = dict(params)
        for names in self.layer_names:
            for fused, parts in FUSED_PARTS.items():
                hf_names = [names[p] for p in parts]
                if not all(n in params for n in hf_names):
                    continue
                tensors = [params.pop(n) for n in hf_names]
                self.storage[names[fused]] = torch.cat(tensors, dim=0)
                row = 0
                for n, t in zip(hf_names, tensors, strict=True):
                    self._views[n] = (names[fused], (slice(row, row + t.shape[0]),))
                    row += t.shape[0]
        for i in self.spec.moe_layers:
            names = self.layer_names[i]
            storage, views = moe.fuse_experts(params, names["experts_gate_up"], names["experts_down"], self.spec)
            self.storage.update(storage)
            self._views.update(views)
        for name, t in params.items():
            self.storage[name] = t
            self._views[name] = None

    def quantize_fp8(self) -> None:
        """Keep the decoder's linear weights as e4m3 with 128x128 block scales (fp8.py); dense models only.
        Each part of a fused projection owns whole blocks, so a push of one part requantizes its blocks alone:
        where a part does not start and end on a 128-row boundary, the parts are laid out from block
        boundaries (`Fp8Weight.from_parts`) and the part's view points at its new rows."""
        if self.spec.moe_layers:
            raise ValueError("FP8 serving covers dense models; this checkpoint has MoE layers")
        for key, t in list(self.storage.items()):
            if not isinstance(t, torch.Tensor) or not key.startswith("model.layers.") or t.dim() != 2:
                continue
            if (
                not key.endswith((".weight", "[qkv].weight", "[gate_up].weight"))
                or "norm" in key
                or "mlp.gate." in key
            ):
                continue
            parts = [(n, v) for n, v in self._views.items() if v is not None and v[0] == key]
            rows = [(n, index[0].start, index[0].stop) for n, (_, index) in parts]  # fused parts: (slice,)
            if not any(a % fp8.BLOCK or b % fp8.BLOCK and b != t.shape[0] for _, a, b in rows):
                self.storage[key] = fp8.Fp8Weight(*fp8.quantize_weight(t))
                continue
            self.storage[key], starts = fp8.Fp8Weight.from_parts(t, [(a, b) for _, a, b in rows])
            for (n, a, b), start in zip(rows, starts, strict=True):
                self._views[n] = (key, (slice(start, start + b - a),))
        self.rebuild_views()

    def rebuild_views(self) -> None:
        for name, view in self._views.items():
            self.params[name] = self.storage[name] if view is None else self.storage[view[0]][view[1]]

    def move_to(self, device: torch.device | str) -> None:
        """Move all weights (e.g. to host memory and back); `params` views are rebuilt on the new storage."""
        self.storage = {k: t.to(device) for k, t in self.storage.items()}
        self.rebuild_views()
        self._rope_table = self._aranges = self._mask_fill = None  # rebuilt on the next forward

    def lm_head_weight(self) -> torch.Tensor:
        return self.params["model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"]

    def canonical_name(self, name: str) -> str:
        """Map a tied `lm_head.weight` onto the embedding it shares storage with."""
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

    def weight_target(self, name: str) -> torch.Tensor | None:
        """The live tensor an HF-named weight is copied into (None: this model has no such weight): any
        checkpoint name, a tied `lm_head.weight`, or a fused expert name (`mlp.experts.gate_up_proj`)."""
        key = self.canonical_name(name)
        if key in self.params:
            return self.params[key]
        if moe.FUSED_EXPERTS.match(name):
            return self.storage.get(name)
        return None

    # ---- forward -------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [..., head_dim] of `positions` (see `_attention` for the sign)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin() * self._rope_sign.to(positions.device)
        if self.dtype != torch.float32:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return cos, sin

    def _rope_lookup(self, positions: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rope() of positions < limit by one table lookup (same elementwise values as rope())."""
        if limit > self._rope_table_len:
            return self.rope(positions)
        emb = F.embedding(positions, self.rope_table_covering(0))
        return emb[..., : self.spec.head_dim], emb[..., self.spec.head_dim :]

    def rope_table_covering(self, n: int) -> torch.Tensor:
        """The [P, 2 x head_dim] cos | signed-sin table, built once, grown to at least n positions."""
        if self._rope_table is None or self._rope_table.shape[0] < n:
            self._rope_table_len = max(self._rope_table_len, n)
            cos, sin = self.rope(torch.arange(self._rope_table_len, device=self.device))
            self._rope_table = torch.cat((cos, sin), dim=-1)
        return self._rope_table

    def arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the model's device, a view of one kept tensor (no allocation per step)."""
        if self._aranges is None or self._aranges.shape[0] < n:
            self._aranges = torch.arange(max(n, 4096), device=self.device)
        return self._aranges[:n]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        slot_start: int,
        write_pos: torch.Tensor,
        kv_len: int | None,
        out_index: torch.Tensor | None = None,
        routing: moe.Routing | None = None,
        extend_len: int | None = None,
    ) -> torch.Tensor:
        """Run the decoder over tokens [B, T] of the slots [slot_start, slot_start+B); return hidden [B, T, D].

        kv_len None: prefill from position 0 (causal attention over the fresh keys; padded tail queries
        are discarded by the caller). kv_len L: decode (T == 1) attending to cache positions < L masked by
        position. K/V of every token are written to the cache at `write_pos` (scratch slot for padding).

        out_index [B] (prefill only): return just the hidden state of token out_index[b] of each row,
        [B, D]. The last layer then needs every token only for its K/V: its attention (over the cache,
        as in decode), output projection, MLP and the final norm run for those B tokens alone.

        The residual stream is kept flat, [B * T, D], so that each residual add rides on the GEMM before
        it (`addmm` accumulates into it): at decode sizes on CPU every op's dispatch costs about as much
        as its arithmetic. In a bf16 model it is fp32 (`fp32_residual`; the module doc says why).

        routing: collects the top-k experts of all B * T tokens at every MoE layer (not with out_index,
        whose last layer runs for the selected tokens only).

        extend_len L (prefill with kv_len None and out_index): the slots already hold K/V before each row's
        first position (a prefix cache hit); tokens attend over cache positions < L masked by position.

        Every read of the cache (decode, extend, the last layer with out_index) goes through `kv.read`, which
        hands an FP8 cache's slices back in the model dtype; the other layers of a prefill from position 0
        attend over their fresh keys in the model dtype (as SGLang's prefill does).
        """
        s, st = self.spec, self.storage
        B, T = tokens.shape
        if routing is not None and out_index is not None:
            raise ValueError("forward: routing is recorded for every token; call it without out_index")
        h = F.embedding(tokens.reshape(-1), st["model.embed_tokens.weight"])
        if self.fp32_residual:
            h = h.float()
        cos, sin = self._rope_lookup(positions.reshape(-1), extend_len or (T if kv_len is None else kv_len))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B * T, 1, hd]: the same for every head
        rows = kv.cache_rows(slot_start, write_pos)  # [B * T, kv_heads]: where this step's K/V go
        keep = None if kv_len is None else self._decode_mask(positions[:, -1], kv_len)
        if extend_len is not None:
            keep, kv_len = self.extend_mask(positions, extend_len), extend_len
        select = None
        for i, names in enumerate(self.layer_names):
            if out_index is not None and i + 1 == s.num_layers:
                select = self.arange(B) * T + out_index  # flat rows of the tokens that go on
                if extend_len is None:
                    keep, kv_len = self._decode_mask(out_index, T), T
                else:
                    keep = self._decode_mask(positions[self.arange(B), out_index], extend_len)
            x = rms_norm(h, st[names["ln1"]], s.rms_norm_eps)
            extend = extend_len is not None and select is None
            h = self._attention(i, names, x, h, (B, T), cos, sin, kv, rows, slot_start, keep, kv_len, select, extend)
            x = rms_norm(h, st[names["ln2"]], s.rms_norm_eps)
            h = (h + self._moe(names, x, routing)) if i in s.moe_layers else self._mlp(names, x, h)
        h = rms_norm(h, st["model.norm.weight"], s.rms_norm_eps)
        return h if out_index is not None else h.view(B, T, -1)

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """LM-head logits; fp32 False keeps the model dtype (the fused sampler reads bf16 as fp32 itself)."""
        out = F.linear(hidden, self.lm_head_weight())
        return out if out.dtype == torch.float32 or not fp32 else out.float()

    def _attention(
        self,
        layer: int,
        names: dict[str, str],
        x: torch.Tensor,
        h: torch.Tensor,
        shape: tuple[int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        rows: torch.Tensor,
        slot_start: int,
        keep: torch.Tensor | None,
        kv_len: int | None,
        select: torch.Tensor | None = None,
        extend: bool = False,
    ) -> torch.Tensor:
        """h + the attention block's output, for the normed tokens x [B * T, D] (shape = (B, T)). select
        [B]: flat rows of one token per sequence, the only ones attended from and returned (see forward).
        extend: every token attends over its slot's cache positions < kv_len, masked by `keep` [B, 1, T, L]."""
        s, st = self.spec, self.storage
        B, T = shape
        H, KVH = s.num_heads, s.num_kv_heads
        qkv = linear(x, st[names["qkv"]], st.get(names["qkv_b"])).view(B * T, H + 2 * KVH, s.head_dim)
        qk = qkv[:, : H + KVH]
        if s.qk_norm:
            qk = torch.cat(
                [
                    rms_norm(qk[:, :H], st[names["qn"]], s.rms_norm_eps),
                    rms_norm(qk[:, H:], st[names["kn"]], s.rms_norm_eps),
                ],
                dim=1,
            )
        # one RoPE for queries and keys; sin carries rotate_half's sign
        qk = qk * cos + torch.roll(qk, s.head_dim // 2, -1) * sin
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH :]
        kv.write(layer, rows, k, v)
        if select is not None:
            q, h = q[select], h[select]
        if kv_len is None:
            q, k, v = (t.view(B, T, -1, s.head_dim).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KVH)
            out = out.transpose(1, 2).reshape(B * T, H * s.head_dim)
        elif extend:
            keys, values = kv.read(layer, slot_start, B, kv_len)
            qb = q.reshape(B, T, H, s.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=keep, enable_gqa=H != KVH)
            out = out.transpose(1, 2).reshape(B * T, H * s.head_dim)
        else:
            out = self._decode_attention(q, kv, layer, slot_start, keep, kv_len).reshape(-1, H * s.head_dim)
        return linear_residual(h, out, st[names["o"]], st.get(names["ob"]))

    def extend_mask(self, positions: torch.Tensor, extend_len: int) -> torch.Tensor:
        """The additive mask [B, 1, T, L] of an extend (positions [B, T]): each token sees the cache positions
        < extend_len at or before its own."""
        keep = torch.where(self.arange(extend_len)[None, None, :] <= positions[:, :, None], *self._mask_values())
        return keep[:, None]

    def _decode_mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The additive mask (0 / -inf) of the cache positions < kv_len each row attends to (those at or
        before its token's position [B]), built once per step in the layout `_decode_attention` takes."""
        keep = torch.where(self.arange(kv_len)[None, :] <= positions[:, None], *self._mask_values())[:, None, None, :]
        if not self._bmm_attention:
            return keep  # [B, 1, 1, L]: SDPA broadcasts it over the heads (the float form it would build itself)
        s = self.spec
        group = s.num_heads // s.num_kv_heads
        return keep.expand(-1, s.num_kv_heads, group, -1).reshape(-1, group, kv_len)  # [B * kvh, group, L]

    def _mask_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0 and -inf as scalar tensors of the model dtype (the additive mask's two values)."""
        if self._mask_fill is None:
            self._mask_fill = (
                torch.zeros((), dtype=self.dtype, device=self.device),
                torch.full((), float("-inf"), dtype=self.dtype, device=self.device),
            )
        return self._mask_fill

    def _decode_attention(
        self, q: torch.Tensor, kv: KVCache, layer: int, start: int, keep: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """Grouped-query attention of one new token per row (q [B, H, hd]) over its cached keys (no K/V
        head repeat: the query heads of a group act as `group` queries of one KV head); returns the H
        heads' outputs in order, [B, kv_heads, group, hd] or its [B * kv_heads, group, hd] view."""
        s = self.spec
        B = q.shape[0]
        group = s.num_heads // s.num_kv_heads
        # [B, kvh, L, hd]: a view (slots are contiguous), or these positions converted from an FP8 cache
        keys, values = kv.read(layer, start, B, kv_len)
        if not self._bmm_attention:
            qg = q.view(B, s.num_kv_heads, group, s.head_dim)
            return F.scaled_dot_product_attention(qg, keys, values, attn_mask=keep)
        # CPU fp32: three batched ops beat SDPA's flash kernel, whose per-(row, head) set-up dominates here
        scores = torch.baddbmm(
            keep, q.reshape(-1, group, s.head_dim), keys.flatten(0, 1).transpose(1, 2), alpha=s.head_dim**-0.5
        )
        return torch.bmm(torch.softmax(scores, dim=-1), values.flatten(0, 1))

    def _mlp(self, names: dict[str, str], x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + the SwiGLU MLP of x (SiLU(gate) * up computed in place, in the gate half of the GEMM output)."""
        gate_up = linear(x, self.storage[names["gate_up"]])
        half = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :half], inplace=True).mul_(gate_up[:, half:])
        return linear_residual(h, act, self.storage[names["down"]], None)

    def _moe(self, names: dict[str, str], x: torch.Tensor, routing: moe.Routing | None) -> torch.Tensor:
        """The MoE block of x [N, D]; `routing` records (or replays) the experts each token went to."""
        st = self.storage
        gate_up, down = st[names["experts_gate_up"]], st[names["experts_down"]]
        return moe.moe_block(x, st[names["router"]], gate_up, down, self.spec, routing, self.moe_impl)
