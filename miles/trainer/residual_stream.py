"""The FSDP trainer's residual stream in fp32 while it computes in bf16 (`--fp32-residual-connection`).

The embedded engine keeps a bf16 model's residual stream in fp32 (miles/engines/embedded/model.py): the
layers' sums are never rounded, every norm rounds its output to bf16 once, and every GEMM reads bf16
inputs. A transformers decoder in bf16 rounds the stream after every residual add instead, twice a layer,
so the trainer's log-probs drift from the engine's by more than the two forwards' kernels would. Here the
trainer's decoder computes as the engine does, on the same module tree and parameters:

- the input embedding's output is widened to fp32 (the stream starts there);
- each decoder RMSNorm (the layers' two and the final one) normalises an fp32 input in fp32, rounds it to the
  weight's dtype and multiplies by the weight in that dtype, the engine's `rms_norm` for an fp32 stream; what
  follows it (attention, MLP or experts, the LM head) reads compute-dtype inputs as before;
- the rotary tables, which transformers casts to the stream's dtype, go back to the compute dtype, so queries
  and keys are rotated as before;
- the residual adds (`residual + block(x)`) then widen by type promotion: an fp32 stream plus a bf16 output.

FSDP2 casts every sharded block's floating inputs to the compute dtype unless told not to, so the
backend builds its mixed-precision policy with `cast_forward_inputs=False` when this is on
(miles/trainer/fsdp.py). Only decoders whose norms are transformers' `*RMSNorm` with `variance_epsilon`
(Qwen2, Qwen3, Qwen3-MoE, Llama, Mistral) are supported; another layout is refused at set-up.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_CLASSES = ("Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "LlamaRMSNorm", "MistralRMSNorm")


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The engine's RMSNorm of an fp32 stream: normalised in fp32, rounded once, times the weight."""
    if x.dtype != torch.float32:  # not on the stream (a caller of its own): transformers' formula
        return type(self).__mro__[1].forward(self, x)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * y.to(self.weight.dtype)


def _stream_class(cls: type) -> type:
    """`cls` with the stream's forward: the norm's class is swapped, not its instance `forward`, which
    transformers' kernel hooks reset whenever the model changes between train and eval mode."""
    name = f"Fp32Stream{cls.__name__}"
    if name not in globals():  # module-level, so that the class pickles by name
        globals()[name] = type(name, (cls,), {"forward": _norm_forward, "__module__": __name__})
    return globals()[name]


def _decoder_norms(decoder: nn.Module | None, model: nn.Module) -> list[nn.Module]:
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None or not hasattr(decoder, "norm"):
        raise ValueError(
            f"--fp32-residual-connection: {type(model).__name__} is not a decoder with .layers and a final .norm; "
            "drop --fp32-residual-connection for this model"
        )
    norms = [decoder.norm]
    for layer in layers:
        norms += [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    for norm in norms:
        name = type(norm).__name__.removeprefix("Fp32Stream")
        if norm is None or name not in NORM_CLASSES or not hasattr(norm, "variance_epsilon"):
            raise ValueError(
                f"--fp32-residual-connection supports decoders whose layer norms are {', '.join(NORM_CLASSES)}; "
                f"{type(model).__name__} has {type(norm).__name__}: drop --fp32-residual-connection for this model"
            )
    return norms


def keep_fp32_residual(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Set `model` (a transformers causal LM or value model, before sharding) to carry its residual stream in
    fp32 while computing in `compute_dtype`. A no-op when that is fp32 already."""
    if compute_dtype == torch.float32:
        return
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norms = _decoder_norms(decoder, model)
    decoder.get_input_embeddings().register_forward_hook(lambda _m, _a, out: out.float())
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        rotary.register_forward_hook(lambda _m, _a, out: tuple(t.to(compute_dtype) for t in out))
    for norm in norms:
        if not type(norm).__name__.startswith("Fp32Stream"):
            norm.__class__ = _stream_class(type(norm))
