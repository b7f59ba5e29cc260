"""megatron-core MoE layers for Qwen3-MoE in the megatron backend, with routing replay (R3).

Every decoder layer's MLP is megatron-core's `MoELayer`: a top-k router, the experts as a `SequentialMLP`
(one ColumnParallelLinear / RowParallelLinear pair per local expert, split over expert-tensor-parallel
ranks; megatron-core's grouped-GEMM experts need Transformer Engine, which the backend does not use) and
the `alltoall` token dispatcher, which exchanges tokens between expert-parallel ranks.

The router is `ReplayableRouter`: megatron-core's TopKRouter (its gate weight, fp32 logits) with the
routing of transformers' Qwen3-MoE router, op for op: softmax over all experts, top-k, the weights
renormalised when `norm_topk_prob`. No load-balancing loss is added (`--train-backend fsdp` adds none
either: the RL losses alone train the policy). Where a `RoutingReplay` is installed
(`--use-rollout-routing-replay` / `--use-routing-replay`), the replayed experts replace the router's
top-k; the weights are still the router's softmax at those experts, so the router keeps its gradient,
exactly as in the FSDP forward (`routing_replay.py`, whose data layout and metrics this shares).
"""

from __future__ import annotations

import types

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.router import TopKRouter

from miles.trainer.mcore_convert import ModelShape
from miles.trainer.routing_replay import RoutingReplay


def moe_config_fields(s: ModelShape, *, ep: int, etp: int) -> dict:
    """TransformerConfig's MoE fields for a Qwen3-MoE shape (empty for a dense model); the token dispatcher
    is the `alltoall` one `transformer_config` sets for every model."""
    if not s.num_experts:
        return {}
    return {
        "num_moe_experts": s.num_experts,
        "moe_router_topk": s.moe_topk,
        "moe_ffn_hidden_size": s.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": True,  # softmax over all experts, then top-k (ReplayableRouter does both)
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,  # SequentialMLP: grouped GEMMs need Transformer Engine
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }


class ReplayableRouter(TopKRouter):
    """TopKRouter routing as transformers' Qwen3-MoE router, replaying a `RoutingReplay`'s experts when set.

    `replay` / `replay_layer` are set by `McoreRoutingReplay`; None means the router's own top-k.
    """

    replay: RoutingReplay | None = None
    replay_layer: int = 0

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """The router's logits in fp32 with autocast off: megatron-core's gating function casts to fp32 itself,
        but under bf16 autocast its matmul would run in bf16 and its backward would then mix bf16 and fp32."""
        with torch.autocast(input.device.type, enabled=False):
            return super().gating(input)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """logits [s, b, E] -> (probs [s*b, E] with the k routing weights of each token, bool routing map)."""
        logits = logits.reshape(-1, self.config.num_moe_experts)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_value, top_idx = torch.topk(probs, self.topk, dim=-1)
        own, replay = top_idx, self.replay
        if replay is not None:
            forced = replay.forced
            if forced is not None:
                forced = forced[:, self.replay_layer]
                top_idx = torch.where(forced >= 0, forced, top_idx)
                top_value = probs.gather(1, top_idx)
            if replay.observed[self.replay_layer] is not False:
                replay.observed[self.replay_layer] = (own.detach(), top_idx.detach())
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        routing_probs = torch.zeros_like(probs).scatter(1, top_idx, top_value)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top_idx, True)
        return routing_probs.to(logits.dtype), routing_map


def moe_mlp_spec(norm_topk_prob: bool):
    """The layer's MLP spec: megatron-core's local MoE spec with `ReplayableRouter` as its router."""
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=1, moe_grouped_gemm=False)
    router = types.new_class("Qwen3MoeRouter", (ReplayableRouter,))
    router.norm_topk_prob = norm_topk_prob
    spec.keywords["submodules"].router = router
    return spec


def mcore_routers(model: torch.nn.Module) -> list[ReplayableRouter]:
    """The model's routers in layer order."""
    routers = [m for m in model.modules() if isinstance(m, ReplayableRouter)]
    return sorted(routers, key=lambda r: r.layer_number)


class McoreRoutingReplay(RoutingReplay):
    """`RoutingReplay` over a megatron-core model's `ReplayableRouter`s (one pipeline stage holding every layer).

    The forward's token order is the THD-packed row of the micro-batch (`flat_token_positions(sub, "row")`).
    """

    def __init__(self, model: torch.nn.Module, *, mode: str) -> None:
        routers = mcore_routers(model)
        self._init_state(routers, mode)
        for layer, router in enumerate(routers):
            router.replay, router.replay_layer = self, layer
