"""The embedded engine's mixture-of-experts block (qwen3_moe): router, top-k, experts, and the routing record.

Weights: a layer's experts live in two stacked tensors, as transformers 5 holds them:
`gate_up` [E, 2I, D] (gate rows, then up rows) and `down` [E, D, I]. `fuse_experts` builds them from a
checkpoint in either naming (miles/utils/moe_names.py) and returns the per-expert views the engine
publishes under the checkpoint names.

Routing follows the HF router op for op: softmax of the router logits in fp32, top-k, renormalised
when `norm_topk_prob`, cast back to the model dtype. `Routing` records the top-k ids of every MoE
layer in forward order (for `return_routed_experts`).

Expert compute (`moe_block`): the token-expert pairs are sorted by expert once, then each expert's
rows run as one GEMM pair (`experts_grouped`); on CUDA the grouped GEMMs are Triton kernels over the
whole sorted batch at once (miles/engines/embedded/moe_triton.py), with static shapes and no host sync,
so a decode step can be captured in a CUDA graph. `experts_loop` is the per-expert reference loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from miles.utils.moe_names import FUSED_EXPERTS
from miles.utils.routing import routing_dtype

__all__ = ["FUSED_EXPERTS", "Routing", "experts_loop", "fuse_experts", "moe_block", "route", "routed_rows"]


@dataclass(slots=True)
class Routing:
    """The experts of every MoE layer, in forward order: `layers[j]` is layer j's top-k ids [N, k]."""

    layers: list[torch.Tensor] = field(default_factory=list)

    def stacked(self) -> torch.Tensor:
        """[N, moe_layers, k] (int64, on the model's device)."""
        return torch.stack(self.layers, dim=1)


def fuse_experts(
    params: dict[str, torch.Tensor], gate_up_name: str, down_name: str, spec
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, tuple]]]:
    """Pop a layer's expert tensors from `params` (fused or per-expert names) and return (storage, views):
    storage {gate_up_name: [E, 2I, D], down_name: [E, D, I]} and, for each per-expert checkpoint name,
    (storage key, index) of its view. Raises naming the first missing tensor."""
    prefix = gate_up_name.rsplit(".", 1)[0]
    n = spec.num_experts
    if gate_up_name in params or down_name in params:
        missing = [k for k in (gate_up_name, down_name) if k not in params]
        if missing:
            raise ValueError(f"checkpoint has fused experts but lacks {missing[0]!r}; is the checkpoint complete?")
        gate_up, down = params.pop(gate_up_name), params.pop(down_name)
    else:
        names = [f"{prefix}.{e}.{w}.weight" for e in range(n) for w in ("gate_proj", "up_proj", "down_proj")]
        missing = [k for k in names if k not in params]
        if missing:
            raise ValueError(
                f"checkpoint is missing expert tensor {missing[0]!r} ({len(missing)} missing); "
                f"is it a complete HF {spec.model_type} checkpoint with {n} experts?"
            )
        parts = [params.pop(k) for k in names]
        gate_up = torch.stack([torch.cat(parts[3 * e : 3 * e + 2]) for e in range(n)])
        down = torch.stack(parts[2::3])
    if gate_up.dim() != 3 or gate_up.shape[0] != n or down.shape[0] != n:
        raise ValueError(
            f"{gate_up_name!r} is {tuple(gate_up.shape)} and {down_name!r} {tuple(down.shape)}; "
            f"expected [{n}, 2 x moe_intermediate_size, hidden] and [{n}, hidden, moe_intermediate_size]"
        )
    half = gate_up.shape[1] // 2
    views: dict[str, tuple[str, tuple]] = {}
    for e in range(n):
        views[f"{prefix}.{e}.gate_proj.weight"] = (gate_up_name, (e, slice(0, half)))
        views[f"{prefix}.{e}.up_proj.weight"] = (gate_up_name, (e, slice(half, 2 * half)))
        views[f"{prefix}.{e}.down_proj.weight"] = (down_name, (e,))
    return {gate_up_name: gate_up.contiguous(), down_name: down.contiguous()}, views


def route(x: torch.Tensor, router: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in x's dtype, expert ids [N, k] int64) of the tokens x [N, D], as the HF router."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def moe_block(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    spec,
    routing: Routing | None,
    impl: str = "grouped",
) -> torch.Tensor:
    """The MoE MLP of x [..., D]: route, record the ids in `routing` (if given), run the chosen experts
    (`impl`: "grouped", or "loop", the per-expert reference loop)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = route(flat, router, spec.num_experts_per_tok, spec.norm_topk_prob)
    if routing is not None:
        routing.layers.append(experts)
    run = experts_loop if impl == "loop" else experts_grouped
    return run(flat, weights, experts, gate_up, down).reshape(shape)


def experts_loop(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Σ_k weights[:, k] * expert_{experts[:, k]}(x): one GEMM pair per expert that any token chose
    (the HF experts' loop; the baseline the grouped path is measured against)."""
    out = torch.zeros_like(x)
    half = gate_up.shape[1] // 2
    for e in torch.unique(experts).tolist():
        token_idx, k_pos = torch.where(experts == e)
        gu = F.linear(x[token_idx], gate_up[e])
        ye = F.linear(F.silu(gu[:, :half]) * gu[:, half:], down[e])
        out.index_add_(0, token_idx, ye * weights[token_idx, k_pos, None])
    return out


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The same sum as `experts_loop`, computed over the token-expert pairs sorted by expert."""
    from miles.engines.embedded import moe_triton

    if moe_triton.usable(x):
        return moe_triton.fused_experts(x, weights, experts, gate_up, down)
    return _experts_sorted_torch(x, weights, experts, gate_up, down)


def _experts_sorted_torch(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Sort the N x k pairs by expert once, then one GEMM pair per contiguous expert segment (the CPU path:
    its segment bounds are read on the host, which costs nothing there)."""
    n, k = experts.shape
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=gate_up.shape[0]).tolist()
    rows = x[order // k]
    half = gate_up.shape[1] // 2
    out_sorted = torch.empty_like(rows)
    start = 0
    for e, c in enumerate(counts):
        if c:
            gu = F.linear(rows[start : start + c], gate_up[e])
            out_sorted[start : start + c] = F.linear(F.silu(gu[:, :half]) * gu[:, half:], down[e])
            start += c
    pairs = torch.empty_like(out_sorted)
    pairs[order] = out_sorted * weights.reshape(-1)[order, None]
    return pairs.view(n, k, -1).sum(dim=1)


def routed_rows(
    decode: list, prefill: list, decode_routing: Routing | None, prefill_routing: Routing | None
) -> dict[int, tuple[int, np.ndarray]]:
    """Step index -> (first position, rows [n, moe_layers, k] in the request's dtype) for every scheduler request of
    the step that records its routing: a decode row covers the token fed at position seq_len - 1, a
    prefill covers positions 0..seq_len - 1 (a re-prefill rewrites them with the current weights' choice)."""
    out: dict[int, tuple[int, np.ndarray]] = {}
    if decode_routing is not None:
        rows = decode_routing.stacked().cpu().numpy()  # [B, layers, k]
        for i, req in enumerate(decode):
            if req.routed is not None:
                out[i] = (req.seq_len - 1, rows[i].astype(req.routed.dtype))
    if prefill_routing is not None:
        width = max(r.seq_len for r in prefill)
        flat = prefill_routing.stacked().cpu().numpy()  # [B * width, layers, k]
        rows = flat.reshape(len(prefill), width, *flat.shape[1:])
        for j, req in enumerate(prefill):
            if req.routed is not None:
                out[len(decode) + j] = (0, rows[j, : req.seq_len].astype(req.routed.dtype))
    return out


def check_routed_request(spec, start_len: int, prompt_len: int) -> None:
    """ValueError (HTTP 400) for `return_routed_experts` on a dense model, or a start outside [0, prompt tokens]
    (as SGLang checks it)."""
    if not spec.moe_layers:
        raise ValueError(
            f"return_routed_experts: this {spec.model_type} model has no MoE layers; drop the field "
            "(--use-rollout-routing-replay is for mixture-of-experts models)"
        )
    if not 0 <= start_len <= prompt_len:
        raise ValueError(f"routed_experts_start_len={start_len} must be in [0, {prompt_len}] (the prompt's tokens)")


def routed_buffer(spec, capacity: int) -> np.ndarray | None:
    """A request's routing record, [capacity, moe_layers, k] in the narrowest type (None: capacity 0, not asked)."""
    if not capacity:
        return None
    return np.zeros((capacity, len(spec.moe_layers), spec.num_experts_per_tok), dtype=routing_dtype(spec.num_experts))
