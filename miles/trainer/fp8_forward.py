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
taken as the identity), with the GEMMs in fp32. This is not FP8 training for speed (no FP8 GEMM runs here,
and the fp32 products cost more than bf16 ones): it is the forward contract, which makes the log-probs the
trainer optimizes those of the policy the engine samples from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.engines.embedded import fp8


def _dequantized_weight(w: torch.Tensor) -> torch.Tensor:
    # the torch form of the engine's quantizer (bit-equal to its Triton pass), which compiled blocks can trace
    return fp8.dequantize_weight(*fp8.quantize_weight_torch(w), torch.float32)


def _straight_through(t: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized` (fp32) in the forward, exactly (t - t is exactly 0); the identity's gradient to `t`. Plain
    ops rather than an autograd.Function, which compiled blocks could not trace."""
    t32 = t.float()
    return quantized + (t32 - t32.detach())


class Fp8BlockwiseLinear(nn.Linear):
    """nn.Linear whose product is the engine's FP8 one (see the module doc); the parameters are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xq = _straight_through(flat, fp8.dequantize_activation(flat.detach()))
        wq = _straight_through(self.weight, _dequantized_weight(self.weight.detach()))
        out = F.linear(xq, wq).to(x.dtype)
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
