"""LoRA on the FSDP trainer (`--lora-rank` > 0): only a low-rank adapter of the policy is trained.

peft injects a `lora_A` / `lora_B` pair beside every targeted linear layer of the HF model, in
place (the model stays a `*ForCausalLM`, so sharding, forward and HF names work unchanged) and
freezes everything else. The layer then computes `W0 x + (alpha / r) * B A x`.

What leaves the trainer is the adapter only:
- weight pushes (`adapter_tensors`) stream `<module>.lora_A.weight` and `<module>.lora_B.weight`
  under the module's HF name (peft's file names without its `base_model.model.` prefix); the
  engine merges them into its resident base weights;
- checkpoints keep the trainable parameters and their optimizer state (the base is the
  `--hf-checkpoint` the run starts from);
- the HF export (`merged_hf_tensors`) writes the merged weights `W0 + (alpha / r) * B A` as a
  plain HF model, and `save_adapter` the adapter beside it in peft's format.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from miles.config import TrainConfig
from miles.engines.embedded.lora import merged_weight

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # peft's name of the one adapter inside each module
ALL_LINEAR = "all-linear"
_ADAPTER_PARAM = re.compile(rf"^(?P<module>.+)\.lora_(?P<ab>[AB])\.{ADAPTER_NAME}\.weight$")
_BASE_PARAM = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True, slots=True)
class LoraSettings:
    rank: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...] | str  # ALL_LINEAR or module names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def engine_config(self) -> dict:
        """The adapter's description for the engines (peft's adapter_config keys, as SGLang's `config_dict`)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": targets,
            "lora_dropout": self.dropout,
            "bias": "none",
        }


def lora_settings(train: TrainConfig) -> LoraSettings | None:
    """The run's LoRA settings, or None for full fine-tuning (`--lora-rank 0`)."""
    if train.lora_rank <= 0:
        return None
    spec = (train.target_modules or ALL_LINEAR).strip()
    targets: tuple[str, ...] | str = (
        ALL_LINEAR if spec == ALL_LINEAR else tuple(m.strip() for m in spec.split(",") if m.strip())
    )
    return LoraSettings(train.lora_rank, train.lora_alpha, train.lora_dropout, targets)


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject the adapter into `model` in place and freeze the rest; ValueError names what cannot be adapted."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=targets, bias="none"
    )
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"--target-modules={settings.target_modules!r}: {e}") from None
    _check_adapted_modules(model)
    for name, p in model.named_parameters():
        p.requires_grad_(_ADAPTER_PARAM.match(name) is not None)
    n_train = sum(p.numel() for p in trainable_parameters(model))
    n_all = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d alpha=%d on %s: %d trainable parameters of %d (%.2f%%)",
        settings.rank,
        settings.alpha,
        settings.target_modules,
        n_train,
        n_all,
        100.0 * n_train / max(n_all, 1),
    )
    return model


def _check_adapted_modules(model: nn.Module) -> None:
    """The engines merge `W0 + s * B A` into plain linear weights: other adapter kinds cannot be served."""
    from peft.tuners.lora import Linear, LoraLayer

    adapted = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not adapted:
        raise ValueError("LoRA found no module to adapt; check --target-modules")
    not_linear = [n for n, m in adapted.items() if not isinstance(m, Linear)]
    if not_linear:
        raise ValueError(
            f"--target-modules adapts {not_linear[:3]}, which are not linear layers; the engines "
            "merge adapters into linear weights only: target linear projections (e.g. q_proj,v_proj)"
        )
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and any(n == "lm_head" or n.endswith(".lm_head") for n in adapted):
        raise ValueError(
            "--target-modules adapts lm_head, whose weight this model ties to the input embedding; "
            "the engine cannot change one without the other: drop lm_head from --target-modules"
        )


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _full(p: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded DTensor: the whole tensor on every rank."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every adapter tensor, full, as `<module>.lora_{A,B}.weight` (same order on every rank)."""
    for name, p in model.named_parameters():
        m = _ADAPTER_PARAM.match(name)
        if m is None:
            continue
        full = _full(p)
        yield f"{m['module']}.lora_{m['ab']}.weight", (full.to(dtype) if dtype is not None else full).detach()


def merged_hf_tensors(
    model: nn.Module, settings: LoraSettings, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: the model's tensors under their HF names, adapted weights merged (`W0 + s * B A`, in fp32)."""
    adapter: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter_tensors(model, torch.float32):
        module, ab = name.rsplit(".lora_", 1)
        adapter.setdefault(module, {})[ab[0]] = t
    for name, p in model.named_parameters():
        if _ADAPTER_PARAM.match(name):
            continue
        full = _full(p).float()
        m = _BASE_PARAM.match(name)
        if m is not None:
            name = f"{m['module']}.{m['leaf']}"
            if m["leaf"] == "weight":
                pair = adapter[m["module"]]
                full = merged_weight(full, pair["A"], pair["B"], settings.scaling)
        yield name, full.to(dtype) if dtype is not None else full


def export_lora_hf(
    path: str, model: nn.Module, settings: LoraSettings, *, dtype: torch.dtype, source_dir: str, write: bool
) -> None:
    """Collective: the merged model as a plain HF directory at `path` (written where `write`, rank 0),
    and the adapter in peft's format in `path/adapter`."""
    from miles.trainer.hf_io import write_hf_dir

    tensors = [(n, t.cpu()) for n, t in merged_hf_tensors(model, settings, dtype)]
    adapter = [(n, t.cpu()) for n, t in adapter_tensors(model)]
    if write:
        write_hf_dir(path, tensors, config=model.config, source_dir=source_dir)
        save_adapter(os.path.join(path, "adapter"), adapter, settings, source_dir)


def save_adapter(path: str, tensors: list[tuple[str, torch.Tensor]], settings: LoraSettings, base_model: str) -> None:
    """The adapter (`adapter_tensors`' output) in peft's format: `adapter_config.json` and
    `adapter_model.safetensors`, loadable with `peft.PeftModel.from_pretrained(base, path)`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    named = {f"base_model.model.{n}": t.detach().cpu().contiguous() for n, t in tensors}
    save_file(named, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        **settings.engine_config(),
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def use_merged_forward(model: nn.Module) -> int:
    """--lora-merged-forward: every adapted linear layer of `model` computes with the weight the embedded engine
    serves, `W0 + (alpha / r) * B A` summed in fp32 (the engine's merge, `engines/embedded/lora.py`) and rounded
    to the input's dtype, instead of `W0 x + (alpha / r) * B A x`. Gradients reach A and B through the merge; the
    backward forms each adapted weight's full gradient, as full fine-tuning does. Returns how many layers."""
    from peft.tuners.lora import Linear

    merged = _merged_linear_class()
    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = merged
            count += 1
    return count


def _merge(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    return merged_weight(w0, a, b, scaling).to(dtype)  # the engine's own merge, rounded as it serves it


@torch.library.custom_op("miles::lora_merged_linear", mutates_args=())
def lora_merged_linear(
    x: torch.Tensor, w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """F.linear(x, merged, bias) with the engine's merged weight. An op of its own so that the merged weight is
    not kept for the backward (it is formed again there, from tensors that are kept anyway)."""
    return F.linear(x, _merge(w0, a, b, scaling, x.dtype), bias)


@lora_merged_linear.register_fake
def _(x, w0, a, b, bias, scaling):
    return x.new_empty((*x.shape[:-1], w0.shape[0]))


def _keep(ctx, inputs, output) -> None:
    x, w0, a, b, bias, scaling = inputs
    ctx.save_for_backward(x, w0, a, b)
    ctx.scaling = scaling


def _merged_backward(ctx, grad: torch.Tensor):
    """The gradients autograd gives `F.linear(x, addmm(w0.float(), b.float(), a.float(), alpha=s).to(dtype), bias)`,
    in the same operations (so the same roundings)."""
    x, w0, a, b = ctx.saved_tensors
    s = ctx.scaling
    need_x, need_w0, need_a, need_b, need_bias = ctx.needs_input_grad[:5]
    grad_x = grad @ _merge(w0, a, b, s, x.dtype) if need_x else None
    flat = grad.reshape(-1, grad.shape[-1])
    weight_grad = (flat.t() @ x.reshape(-1, x.shape[-1])).float()  # the merged weight's, back through the cast
    grad_a = (b.float().t() @ weight_grad * s).to(a.dtype) if need_a else None
    grad_b = (weight_grad @ a.float().t() * s).to(b.dtype) if need_b else None
    grad_w0 = weight_grad.to(w0.dtype) if need_w0 else None
    grad_bias = flat.sum(0) if need_bias else None
    return grad_x, grad_w0, grad_a, grad_b, grad_bias, None


lora_merged_linear.register_autograd(_merged_backward, setup_context=_keep)


@functools.cache
def _merged_linear_class() -> type:
    from peft.tuners.lora import Linear

    class MergedLoraLinear(Linear):
        """peft's LoRA linear layer computing with the engine's merged weight (see `use_merged_forward`)."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            base = self.get_base_layer()
            a, b = self.lora_A[ADAPTER_NAME].weight, self.lora_B[ADAPTER_NAME].weight
            return lora_merged_linear(x, base.weight, a, b, base.bias, float(self.scaling[ADAPTER_NAME]))

    return MergedLoraLinear
