"""The engine's true-on-policy scorer: the model's `transformers` implementation over the engine's weights.

`--true-on-policy-mode` re-scores every finished sequence with the reference forward the trainer
computes its log-probs with (miles/true_on_policy/scoring.py). This module builds that model on the
meta device from the engine's config.json, with eager attention, and gives every parameter a tensor
of its own on the engine's device: a fresh allocation, as the trainer's parameters are (FSDP gathers
each into its own buffer; a plain module clones them), so a GEMM never sees an operand whose alignment
differs from the trainer's. Their values are copied from the engine's live weights whenever those
changed (`sync`, keyed by the runner's KV epoch, which every weight load bumps). Names follow the HF
module (fused MoE experts, `mlp.experts.gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I], are held
so by the engine too). Costs one more copy of the weights on the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from miles.engines.embedded.checkpoint import SUPPORTED_MODEL_TYPES, ModelSpec, read_config
from miles.engines.embedded.model import CausalLM
from miles.true_on_policy import ATTN_IMPLEMENTATION
from miles.true_on_policy.scoring import scaled_log_softmax, sequence_logits

logger = logging.getLogger(__name__)


def coverage_error(model_path: str) -> str | None:
    """Why `--true-on-policy-mode` cannot cover the model at `model_path` (None: it can): the mode covers
    every model the embedded engine serves, whose transformers implementation it scores with."""
    try:
        ModelSpec.from_config(read_config(model_path))
    except (ValueError, KeyError) as e:
        return (
            f"--true-on-policy-mode covers the models the embedded engine serves ({', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"default RoPE) and {model_path} is not one: {e}; drop the mode for this model"
        )
    return None


class ReferenceModel:
    """The HF model of `model_path` bound to copies of `model`'s weights; `score` runs the reference forward."""

    def __init__(self, model_path: str, model: CausalLM) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
        self.hf = hf.eval()
        self.model = model
        self.device = model.device
        self._bindings: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        self._bind_parameters()
        self._build_buffers()
        self._synced_epoch: int | None = None

    def _source(self, name: str) -> tuple[str, Callable[[], torch.Tensor]]:
        """(key, fn returning the engine tensor the HF parameter `name` holds); the key dedups tied weights."""
        model = self.model
        key = model.canonical_name(name)
        if model.weight_target(name) is not None:  # fused MoE experts included (the engine stores them so)
            return key, lambda: model.weight_target(key)
        raise ValueError(
            f"true-on-policy scoring: the transformers {model.spec.model_type} model has a parameter {name!r} "
            "that none of the engine's weights holds; this model cannot be scored exactly"
        )

    def _bind_parameters(self) -> None:
        copies: dict[str, nn.Parameter] = {}
        for name, meta in list(self.hf.named_parameters(remove_duplicate=False)):
            key, source = self._source(name)
            if key not in copies:
                value = source()
                if tuple(value.shape) != tuple(meta.shape):
                    raise ValueError(
                        f"true-on-policy scoring: {name!r} is {tuple(meta.shape)} in the transformers model but "
                        f"{tuple(value.shape)} in the engine"
                    )
                copy = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                copies[key] = nn.Parameter(copy, requires_grad=False)
                self._bindings.append((copy, source))
            owner, _, leaf = name.rpartition(".")
            self.hf.get_submodule(owner)._parameters[leaf] = copies[key]

    def _build_buffers(self) -> None:
        """Buffers (RoPE's inverse frequencies) are computed, not loaded: rebuild their modules for real, on
        the host as the trainer's are (its model is built on CPU and moved), then move them."""
        for name, module in list(self.hf.named_modules()):
            if not any(b.is_meta for b in module.buffers(recurse=False)):
                continue
            if "Rotary" not in type(module).__name__:
                raise ValueError(f"true-on-policy scoring: cannot rebuild buffers of {name} ({type(module).__name__})")
            with torch.device("cpu"):
                rebuilt = type(module)(config=self.hf.config)
            self.hf.set_submodule(name, rebuilt.to(self.device))
        left = [n for n, t in [*self.hf.named_parameters(), *self.hf.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"true-on-policy scoring: tensors still unset after binding: {left[:5]}")

    def sync(self, epoch: int) -> None:
        """Copy the engine's weights in when they changed since the last sync (`epoch`: the runner's KV epoch)."""
        if epoch == self._synced_epoch:
            return
        with torch.no_grad():
            for copy, source in self._bindings:
                storage = copy.untyped_storage()
                if storage.nbytes() == 0:  # released: a fresh allocation, as the first one was
                    storage.resize_(copy.numel() * copy.element_size())
                copy.copy_(source())
        self._synced_epoch = epoch

    def release(self) -> None:
        """Free the copies' memory (the engine released its weights); the next `sync` allocates them again."""
        for copy, _ in self._bindings:
            copy.untyped_storage().resize_(0)
        self._synced_epoch = None

    @torch.no_grad()
    def log_probs(self, ids: list[int], start: int, temperature: float) -> torch.Tensor:
        """fp32 log_softmax(logits / temperature) [len(ids) - start, vocab] of the positions predicting ids[start:]."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return scaled_log_softmax(sequence_logits(self.hf, tokens, start), temperature)
