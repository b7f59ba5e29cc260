"""Offload of the megatron backend: what leaves the GPU between steps, and what the first step still needs.

`offload_to_host` moves the actor's weights, gradient buffers, fp32 master weights and Adam states to
host memory (`HostOffloader`), and the reference model's weights once for good: from then on `onloaded`
brings them back only around the reference model's own forward. `onload_actor` brings the actor back.
`plan_rank_memory` says whether a rank trains without offloading beside its colocated engine.

`offloaders` is the backend's own dict ("actor", "ref" -> HostOffloader): these functions keep their
state there, so the backend holds it and passes it in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

from miles.config import RolloutConfig, TrainConfig
from miles.trainer.offload import HostOffloader, module_onloaded, module_tensors, optimizer_tensors


def actor_tensors(actor: DistributedDataParallel, optimizer: Any) -> Iterator[torch.Tensor]:
    """Every device tensor of the actor: weights, DDP parameter and gradient buffers, the optimizer's
    main parameters and states."""
    yield from module_tensors(actor.module)
    for buf in actor.buffers + actor.expert_parallel_buffers:
        yield from (t for t in (buf.param_data, buf.grad_data) if t is not None)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        yield from (p for group in inner.param_groups for p in group["params"])
        yield from optimizer_tensors(inner)


def offload_to_host(
    offloaders: dict[str, HostOffloader],
    actor: DistributedDataParallel,
    optimizer: Any,
    ref: torch.nn.Module | None,
) -> None:
    """The actor's tensors to host; the reference model's too, the first time."""
    if ref is not None and "ref" not in offloaders:
        offloaders["ref"] = HostOffloader("ref")
        offloaders["ref"].offload(module_tensors(ref))
    offloaders.setdefault("actor", HostOffloader("actor")).offload(actor_tensors(actor, optimizer))


def onload_actor(offloaders: dict[str, HostOffloader]) -> None:
    off = offloaders.get("actor")
    if off is not None and off.is_offloaded:
        off.onload()


def onloaded(
    offloaders: dict[str, HostOffloader], which: str, ref: torch.nn.Module | None
) -> contextlib.AbstractContextManager[None]:
    """The model `which` ("actor", "ref") on the device for the body; an offloaded ref goes back after it."""
    return module_onloaded(offloaders.get("ref") if which == "ref" else None, ref)


def plan_rank_memory(
    actor: DistributedDataParallel,
    optimizer: Any,
    hf_config: Any,
    train: TrainConfig,
    rollout: RolloutConfig,
    device: torch.device,
) -> dict:
    """Whether this rank trains without offloading beside its colocated engine.

    Megatron's gradient buffers exist from the start; what the first step still allocates is Adam's
    two fp32 moments of this rank's optimizer shard (the whole local model, as an upper bound) and a
    micro-batch's activations at the token budget (every layer of the model, also an upper bound).
    """
    from miles.trainer.memory_plan import activation_bytes, micro_batch_tokens, plan

    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    local = sum(p.numel() for p in actor.module.parameters() if p.requires_grad)
    pending = 0 if any(o.state for o in inner) else 2 * local * 4
    tokens = micro_batch_tokens(train, rollout)
    acts = activation_bytes(hf_config, tokens, checkpointing=train.gradient_checkpointing)
    return plan(device, pending, acts, tokens).to_dict()
