"""The FSDP trainer's forward with the FP8 rollout's quantization (`--fp8-format e4m3 --fp8-recipe blockwise`).

Quantizing the rollout alone makes the two sides compute differently from the same weights: on the SmolLM2
recipe an FP8-served run's train/rollout gap is 0.11 nats a token against bf16's 0.025 (bench/results/fp8.md).
Here the trainer's decoder projections compute as the engine's FP8 GEMMs do, with the engine's own quantizer
(miles/engines/embedded/fp8.py, bit for bit): the weight, as the trainer holds it in its compute dtype (the
bytes a weight push sends), quantized to e4m3 with one fp32 scale per 128x128 block; the input quantized per
token and group of 128 channels; their dequantized product summed in fp32 and rounded to the compute dtype,
as the engine's W8A8 product is computed wherever it dequantizes (every GEMM on CPU, and on CUDA unless its
FP8 kernels are switched on). The same projections are quantized as the engine's (q/k/v/o, gate/up/down);
embeddings, norms, the LM head and MoE experts stay as they are, as the engine keeps them.

The backward is straight through: each operand's gradient is that of its dequantized value (the quantizer is
taken as the identity at the quantized point), with the GEMMs in the compute dtype, as a plain linear's. The
product is an op of its own (`miles::fp8_blockwise_product`) that keeps only its bf16 input and weight for the
backward, as a plain linear does, and quantizes them again there. This is not FP8 training for speed (no FP8
GEMM runs here, and the forward's fp32 product costs more than a bf16 one): it is the forward contract, which
makes the log-probs the trainer optimizes those of the policy the engine samples from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.engines.embedded import fp8


def _dequantized_weight(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # the torch form of the engine's quantizer (bit-equal to its Triton pass), which compiled blocks can trace
    return fp8.dequantize_weight(*fp8.quantize_weight_torch(w), dtype)


@torch.library.custom_op("miles::fp8_blockwise_product", mutates_args=())
def fp8_blockwise_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T as the engine's W8A8 product, in x's dtype. An op of its own, so that compiled blocks keep
    its roundings (and trace its straight-through backward) without an autograd.Function, which they could not."""
    return F.linear(fp8.dequantize_activation(x), _dequantized_weight(w)).to(x.dtype)


@fp8_blockwise_product.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _save(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # what a plain linear keeps anyway; the backward quantizes them again


def _straight_through(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a plain GEMM of the dequantized operands, in x's dtype (the quantizer taken as the
    identity at the quantized point)."""
    x, w = ctx.saved_tensors
    grad = grad.to(x.dtype)
    grad_x = grad @ _dequantized_weight(w, x.dtype)
    grad_w = grad.t() @ fp8.dequantize_activation(x).to(x.dtype)
    return grad_x, grad_w.to(w.dtype)


fp8_blockwise_product.register_autograd(_straight_through, setup_context=_save)


class Fp8BlockwiseLinear(nn.Linear):
    """nn.Linear whose product is the engine's FP8 one (see the module doc); the parameters are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = fp8_blockwise_product(flat, self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def use_fp8_forward(model: nn.Module, recipe: str = "blockwise") -> int:
    """Give the decoder projections of `model` (a transformers causal LM, before sharding) the FP8 product of
    `recipe` (--fp8-recipe; blockwise, the engine's scaling, is the one there is); returns how many. Refuses a
    model where none matches the engine's quantized names."""
    if recipe != "blockwise":
        raise ValueError(f"--fp8-recipe {recipe!r}: the FP8 rollout scales 128x128 weight blocks; use blockwise")
    count = 0
    for name, module in model.named_modules():
        if fp8.is_quantized_name(f"{name}.weight") and type(module) is nn.Linear:  # the engine's FP8 names
            module.__class__ = Fp8BlockwiseLinear
            count += 1
    if not count:
        raise ValueError(
            f"--fp8-format: {type(model).__name__} has none of the projections the engine serves in FP8 "
            "(model.layers.N.self_attn.q_proj ... mlp.down_proj as nn.Linear); drop --fp8-format"
        )
    return count
