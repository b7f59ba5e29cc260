"""How the FSDP trainer lays out its model: sharding with fully_shard, the global-norm clip, the AdamW kernel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(
    model: nn.Module,
    mesh,
    mp_policy: MixedPrecisionPolicy | None,
    *,
    compile_blocks: bool = False,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """fully_shard each transformer block (HF `_no_split_modules`), then the root.

    With one rank there is nothing to save by freeing gathered parameters after forward, so they
    stay gathered until backward instead of being gathered twice. With one rank and no mixed
    precision FSDP has no work at all (no shards, no casts, a sum over one rank) besides copying
    every parameter in before forward and every gradient out after backward, so the model stays
    a plain module, as torchtitan does without a sharded data-parallel dimension.
    `reshard_after_forward=True` frees the gathered compute copies after forward on one rank too
    (the memory levers: a 14B model's bf16 copy is 30 GB).
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules; cannot find transformer blocks to shard"
        )
    if compile_blocks:  # in place, so parameter names (HF names) stay as they are
        for block in blocks:
            block.compile(dynamic=True)
    if mesh.size() == 1 and mp_policy is None:
        return own_parameters(model.to(mesh.device_type))
    reshard = mesh.size() > 1 if reshard_after_forward is None else reshard_after_forward
    kw = {"mesh": mesh, "reshard_after_forward": reshard} | ({"mp_policy": mp_policy} if mp_policy else {})
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if mesh.size() == 1:
        return model  # nothing to divide by: an explicit factor would only add a division pass per group
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Sum over ranks (losses carry global denominators). Forcing plain SUM collectives avoids
            # PREMUL_SUM, which gloo lacks, and keeps NCCL on its zero-copy path.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The parameters of `model` in `dtype`, its buffers as they were (as a mixed-precision policy casts).

    `model.to(dtype)` would also cast floating buffers, such as the rotary embedding's `inv_freq`: in bf16
    every position's angle moves, and the forward is no longer the one the other optimizer placements run.
    """
    buffers = list(model.named_buffers())
    model.to(dtype)
    for name, buf in buffers:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buf
    return model


def own_parameters(model: nn.Module) -> nn.Module:
    """Give every parameter storage of its own, as fully_shard does: HF may load them as views of the
    memory-mapped checkpoint, which can be neither offloaded (resized) nor should be written in place."""
    for p in model.parameters():  # tied weights are one Parameter, so they stay tied
        p.data = p.data.clone()
    return model


def clip_sharded_grad_norm(
    model: nn.Module, max_norm: float, device: torch.device, grads: list[torch.Tensor] | None = None
) -> float:
    """Global grad norm over all shards, and clipping, on the local shards.

    Works on each DTensor's local tensor with foreach kernels plus one all-reduce, instead of
    per-parameter DTensor dispatch: same result, far less CPU time per step. `grads`: where the
    gradients are when not in `.grad` (`--optimizer-cpu-offload` accumulates them in fp32 buffers).
    """
    if grads is None:
        grads = [
            p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            for p in model.parameters()
            if p.grad is not None
        ]
    grads = [g for g in grads if g.numel()]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        sq = torch.stack(torch._foreach_norm(grads, 2.0)).float().square().sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(sq)
    norm = sq.sqrt()
    if grads and max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return float(norm.item())


def adamw_kernels(model: nn.Module, device: torch.device) -> dict[str, bool]:
    """Fused AdamW (one pass over each tensor) for plain parameters: on GPU, and on a single CPU rank.

    FSDP's sharded parameters on CPU take the foreach path instead: one DTensor dispatch per op for
    all parameters rather than one per parameter, and bit-identical to the per-tensor default with
    which the CPU standard runs (tests/standards) were recorded; fused kernels would round differently.
    """
    if device.type == "cuda" or not isinstance(next(model.parameters()), DTensor):
        return {"fused": True}
    return {"foreach": True}
