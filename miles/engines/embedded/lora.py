"""LoRA adapters on the embedded engine: the newest adapter merged into the resident base weights.

An adapter is a set of `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r]
tensors under the module's HF name, with `r` and `lora_alpha` in its config. Loading one sets
every adapted weight to `W0 + (lora_alpha / r) * B @ A` (computed in fp32, then cast to the
engine dtype) in place, so every forward path (eager, fused kernels, CUDA graphs, which hold the
weights' addresses) serves it with no extra work per token. `W0` is the base weight as the engine
loaded it: a host copy of each adapted weight is taken the first time an adapter touches it,
and every later adapter is merged from that copy, never from the previous merge, so adapters do
not accumulate rounding. Unloading writes the base back.

The engine serves one adapter, to every request. A module the new adapter no longer touches is
restored to its base.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_dict(cls, config: dict) -> AdapterConfig:
        """peft's adapter_config keys (SGLang's `config_dict`): `r` and `lora_alpha`."""
        try:
            rank, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"LoRA config_dict needs integer 'r' and number 'lora_alpha', got {config!r}") from e
        if rank < 1:
            raise ValueError(f"LoRA config_dict r={rank} must be >= 1")
        if config.get("use_rslora") or config.get("use_dora"):
            raise ValueError("LoRA config_dict asks for rsLoRA or DoRA; the engine merges plain LoRA only")
        return cls(rank, alpha)


def group_adapter(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": tensor, "B": tensor}} from the adapter's named tensors; ValueError for anything else."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{name!r} is not a LoRA tensor (expected <module>.lora_A.weight or .lora_B.weight)")
        module, part = name[: -len(suffix)], _SUFFIXES[suffix]
        if part in modules.setdefault(module, {}):
            raise ValueError(f"{name!r} appears twice in the adapter")
        modules[module][part] = tensor
    incomplete = [m for m, parts in modules.items() if len(parts) != 2]
    if incomplete:
        raise ValueError(f"the adapter lacks lora_A or lora_B for {incomplete[:3]}")
    if not modules:
        raise ValueError("the adapter holds no tensors")
    return modules


def merged_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W0 + scaling * B A`, summed in fp32: the weight an adapter makes. One formula for the engine's merge, the
    trainer's `--lora-merged-forward` and its merged HF export, so that all three round alike."""
    return torch.addmm(w0.float(), b.float(), a.float(), alpha=scaling)


class AdapterMerger:
    """Applies one adapter at a time to `params` (HF name -> live weight tensor, written in place)."""

    def __init__(self, params: dict[str, torch.Tensor], tied_names: frozenset[str] = frozenset()) -> None:
        self.params = params
        self.tied_names = tied_names  # weight names that share storage with another (a tied lm_head)
        self.base: dict[str, torch.Tensor] = {}  # weight name -> the engine's base, on host
        self.name: str | None = None

    @property
    def active(self) -> bool:
        return self.name is not None

    def load(self, named: Iterable[tuple[str, torch.Tensor]], config: dict, name: str) -> int:
        """Merge the adapter into the weights (from their base); returns the number of adapted weights."""
        cfg = AdapterConfig.from_dict(config)
        modules = group_adapter(named)
        weights = {f"{m}.weight": self._check(m, parts, cfg.rank) for m, parts in modules.items()}
        for stale in set(self.base) - set(weights):
            self.params[stale].copy_(self.base.pop(stale))
        for weight, (a, b) in weights.items():
            live = self.params[weight]
            if weight not in self.base:
                self.base[weight] = live.detach().to("cpu", copy=True)
            base, a, b = (t.to(live.device) for t in (self.base[weight], a, b))
            live.copy_(merged_weight(base, a, b, cfg.scaling))
        self.name = name
        logger.info(
            "LoRA adapter %r (r=%d, scaling %.4g) merged into %d weights", name, cfg.rank, cfg.scaling, len(weights)
        )
        return len(weights)

    def unload(self) -> int:
        """Write every adapted weight's base back; returns how many."""
        restored = len(self.base)
        for weight, base in self.base.items():
            self.params[weight].copy_(base)
        self.base.clear()
        self.name = None
        return restored

    def _check(self, module: str, parts: dict[str, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = f"{module}.weight"
        if weight in self.tied_names:
            raise ValueError(
                f"LoRA on {module!r}: its weight is tied to the input embedding; the engine cannot "
                "adapt one without the other"
            )
        if weight not in self.params:
            raise ValueError(f"LoRA module {module!r} has no weight {weight!r} in this model")
        a, b = parts["A"], parts["B"]
        out_dim, in_dim = self.params[weight].shape
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
            raise ValueError(
                f"LoRA shapes for {module!r}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; "
                f"expected ({rank}, {in_dim}) and ({out_dim}, {rank}) for r={rank}"
            )
        return a, b
