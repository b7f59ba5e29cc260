"""Routing replay in the trainer's forward (FSDP here; megatron: mcore_moe.py): `--use-rollout-routing-replay` (R3) and `--use-routing-replay`.

An MoE router picks each token's top-k experts; the engine that sampled a token and the trainer that
scores it compute the router logits with different kernels, so near ties resolve differently and the
trainer's log-prob comes from other experts than the sample did (report §2.5). Replay installs itself
on every router of the HF model (modules with `top_k`, `num_experts` and a `weight` [E, D], as
transformers' `Qwen3MoeTopKRouter`) and, where a replay is set for the forward, uses the given experts
instead of the router's top-k. The routing weights are still the router's: softmax over all experts,
taken at the replayed ids (renormalised when `norm_topk_prob`), so the router keeps its gradient.

Sources, per sample: R3 replays the engine's routing (`TrainBatch.routed_experts`); `--use-routing-replay`
alone records the trainer's own routing in the step's first forward (the old log-prob pass) and replays
it in the training passes. A sequence's last token has no recorded row (it is never fed to the engine):
that token, and padding, keep the router's own choice; their outputs reach no log-prob.

Measured in the step's first forward, over the tokens with a rollout row: `train/routing_mismatch`, the
share whose experts used by the forward differ (as a set, at any MoE layer) from the rollout's, and
`train/router_rollout_mismatch`, the same for the trainer's own top-k (what R3 replaces).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles.rollout.train_data import TrainBatch
from miles.trainer.packing import flat_token_positions
from miles.utils.routing import routing_dtype

logger = logging.getLogger(__name__)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")]


class RoutingReplay:
    """Installed once on the actor; `scope(...)` sets what one micro-batch forward replays and measures."""

    MODES = ("rollout", "self", "measure")  # R3 | --use-routing-replay | no replay, mismatch measured only

    def __init__(self, model: nn.Module, *, mode: str) -> None:
        self._init_state(moe_routers(model), mode)
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_replaying_forward(self, layer), router)

    def _init_state(self, routers: list[nn.Module], mode: str) -> None:
        """What every forward reads and fills; `routers` in layer order (each has `num_experts` and `weight`)."""
        if mode not in self.MODES:
            raise ValueError(f"routing replay mode {mode!r} is not one of {self.MODES}")
        self.routers = routers
        if not self.routers:
            raise ValueError("routing replay: the model has no MoE routers (a dense model); drop the flag")
        self.mode = mode
        self.dtype = routing_dtype(int(self.routers[0].num_experts))
        self.forced: torch.Tensor | None = None  # [flat tokens, layers, k] int64, -1 = the router's own choice
        self.observed: list[torch.Tensor | None] = [None] * len(self.routers)  # (own top-k, used) per layer
        self.recorded: dict[int, np.ndarray] = {}  # --use-routing-replay: sample_index -> [seq_len - 1, layers, k]
        self.counts = np.zeros(3, np.float64)  # tokens compared, used-routing mismatches, own top-k mismatches
        self.measured = False

    def begin_step(self) -> None:
        self.recorded.clear()
        self.counts[:] = 0
        self.measured = False

    @contextlib.contextmanager
    def scope(self, sub: TrainBatch | None, layout: str, *, first_pass: bool) -> Iterator[None]:
        """Replay (and measure, in the step's first pass) for the forward of micro-batch `sub` (None: a dummy
        pass, routed by the router alone)."""
        measure = sub is not None and (first_pass or not self.measured)
        source = self._source(sub) if sub is not None else None
        total, positions = flat_token_positions(sub, layout) if sub is not None else (0, None)
        if source is not None:
            self.forced = _layout_tensor(source, positions, total, self.routers[0].weight.device)
        record = sub is not None and self.mode == "self" and source is None
        observe = measure or record
        self.observed = [None] * len(self.routers) if observe else [False] * len(self.routers)
        try:
            yield
        finally:
            self.forced = None
        if measure and sub.routed_experts is not None:
            self._measure(sub, positions)
        if record:
            self._record(sub, positions)
        self.observed = [False] * len(self.routers)

    def end_pass(self, first_pass: bool) -> None:
        self.measured = self.measured or first_pass

    def _source(self, sub: TrainBatch) -> list[np.ndarray] | None:
        if self.mode == "measure":
            return None
        if self.mode == "rollout":
            if sub.routed_experts is None:
                raise ValueError(
                    "--use-rollout-routing-replay: the train batch carries no routed experts; every sample needs the "
                    "engine's routing (a custom generate function must send return_routed_experts and keep "
                    "meta_info.routed_experts in Sample.rollout_routed_experts)"
                )
            return sub.routed_per_sample()
        rows = [self.recorded.get(int(i)) for i in sub.sample_index]
        return None if any(r is None for r in rows) else rows

    def _own_and_used(self) -> tuple[torch.Tensor, torch.Tensor]:
        own = torch.stack([o[0] for o in self.observed], dim=1)  # [flat, layers, k]
        used = torch.stack([o[1] for o in self.observed], dim=1)
        return own.cpu(), used.cpu()

    def _measure(self, sub: TrainBatch, positions: list[np.ndarray]) -> None:
        own, used = self._own_and_used()
        idx = torch.from_numpy(np.concatenate([p[:-1] for p in positions]))
        rollout = torch.from_numpy(np.concatenate(sub.routed_per_sample()).astype(np.int64))
        rollout = rollout.sort(-1).values

        def differs(x: torch.Tensor) -> int:
            return int((x[idx].sort(-1).values != rollout).any(-1).any(-1).sum())

        self.counts += (len(idx), differs(used), differs(own))

    def _record(self, sub: TrainBatch, positions: list[np.ndarray]) -> None:
        own, _ = self._own_and_used()
        for i, p in zip(sub.sample_index, positions, strict=True):
            self.recorded[int(i)] = own[torch.from_numpy(p[:-1])].numpy().astype(self.dtype)

    def metrics(self, device: torch.device, group) -> dict[str, float]:
        """The step's mismatch shares over all ranks (nothing when no rollout routing was compared)."""
        t = torch.tensor(self.counts, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        if t[0] == 0:
            return {}
        return {"train/routing_mismatch": float(t[1] / t[0]), "train/router_rollout_mismatch": float(t[2] / t[0])}


def _layout_tensor(
    rows: list[np.ndarray], positions: list[np.ndarray], total: int, device: torch.device
) -> torch.Tensor:
    """[total, layers, k] int64: sample i's row t at positions[i][t]; -1 elsewhere (last tokens, padding)."""
    layers, k = rows[0].shape[1:]
    out = np.full((total, layers, k), -1, np.int64)
    for r, p in zip(rows, positions, strict=True):
        out[p[:-1]] = r
    return torch.from_numpy(out).to(device, non_blocking=True)


def _replaying_forward(replay: RoutingReplay, layer: int):
    """The router's forward (transformers' TopKRouter, op for op) with the top-k ids replaced where replayed."""

    def forward(self: nn.Module, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        router_logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
        top_value, top_idx = torch.topk(probs, self.top_k, dim=-1)
        own = top_idx
        forced = replay.forced
        if forced is not None:
            forced = forced[:, layer]
            top_idx = torch.where(forced >= 0, forced, top_idx)
            top_value = probs.gather(1, top_idx)
        if replay.observed[layer] is not False:
            replay.observed[layer] = (own.detach(), top_idx.detach())
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(router_logits.dtype), top_idx

    return forward


def replay_scope(
    replay: RoutingReplay | None, sub: TrainBatch | None, layout: str, *, first_pass: bool
) -> contextlib.AbstractContextManager:
    """`replay.scope(...)`, or nothing to do when routing replay is off."""
    return contextlib.nullcontext() if replay is None else replay.scope(sub, layout, first_pass=first_pass)
