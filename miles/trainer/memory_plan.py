"""Does the trainer fit beside colocated engines without offloading? An estimate from measured memory.

Colocated, the trainer and the engines share each GPU. Offloading the trainer's state while the
engines generate (and the engines' weights and KV cache while the trainer trains) makes room, at
the cost of host copies every step. Once both sides are loaded, the trainer knows what is left on
its GPU with the engine resident; what it still needs is the state it allocates at its first step
(gradients, the optimizer's moments) and the activations of a micro-batch, bounded by the token
budget. `plan()` compares the two; the controller turns offload off when every rank has room.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

# Bytes a token keeps for backward in one decoder layer of hidden size h, bf16 (Megatron's 34·h
# per token and layer without recomputation), and per vocabulary entry of the logits (bf16 logits,
# their fp32 log-softmax and its gradient chunk).
ACTIVATION_BYTES_PER_HIDDEN = 34
LOGIT_BYTES_PER_VOCAB = 10
HEADROOM = 0.10  # of the GPU's memory, kept free for fragmentation and kernels' workspaces


@dataclass(slots=True)
class MemoryPlan:
    total_bytes: int
    free_bytes: int  # now, with the colocated engines resident
    pending_state_bytes: int  # gradients and optimizer moments not allocated yet
    activation_bytes: int  # one micro-batch at the token budget
    fits: bool
    resident_bytes: int = 0  # what this trainer process holds on the device now (its allocator's reserve)
    tokens: int = 0  # the micro-batch token budget the activations are for
    headroom_bytes: int = 0  # kept free for fragmentation and workspaces

    def to_dict(self) -> dict:
        return asdict(self)


def _local_numel(model: nn.Module) -> int:
    return sum(
        (p._local_tensor if hasattr(p, "_local_tensor") else p).numel() for p in model.parameters() if p.requires_grad
    )


def pending_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Gradients plus AdamW's two moments, in the parameters' dtype, when not allocated yet."""
    numel = _local_numel(model)
    itemsize = next(model.parameters()).element_size()
    grads = 0 if any(p.grad is not None for p in model.parameters()) else numel * itemsize
    moments = 0 if optimizer.state else 2 * numel * itemsize
    return grads + moments


def activation_bytes(config, tokens: int, *, checkpointing: bool) -> int:
    """Upper estimate of one micro-batch's activations and logits."""
    hidden = int(getattr(config, "hidden_size", 0))
    layers = int(getattr(config, "num_hidden_layers", 0))
    vocab = int(getattr(config, "vocab_size", 0))
    per_layer = 2 * hidden if checkpointing else ACTIVATION_BYTES_PER_HIDDEN * hidden
    return tokens * (layers * per_layer + LOGIT_BYTES_PER_VOCAB * vocab)


def micro_batch_tokens(train, rollout) -> int:
    """The most tokens one micro-batch holds: the dynamic budget, else micro-batch size x the longest sample."""
    if train.use_dynamic_batch_size:
        return int(train.max_tokens_per_gpu)
    longest = (rollout.rollout_max_prompt_len or 2048) + (rollout.rollout_max_response_len or 2048)
    return int(train.micro_batch_size * longest)


def plan(device: torch.device, pending: int, activations: int, tokens: int = 0) -> MemoryPlan:
    free, total = torch.cuda.mem_get_info(device)
    headroom = int(HEADROOM * total)
    fits = pending + activations + headroom <= free
    resident = torch.cuda.memory_reserved(device)
    return MemoryPlan(
        int(total), int(free), int(pending), int(activations), fits, int(resident), int(tokens), headroom
    )
