"""The embedded engine's weights and the memory they live in: updates by HF name, LoRA adapters, the
direct colocated buffer (miles/weights/colocated_direct.py), and releasing/resuming weights and KV cache.

`EngineWeights` is a part of `EmbeddedEngine` (engine.py), which builds `model`, `runner`, `device`,
`fp8`, `scheduler` and `reference` and calls `init_weight_state` once the runner exists. Every mutation
holds the runner's lock and bumps its KV epoch, so no token is produced from KV of older weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

import torch

from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import iter_safetensors, read_config
from miles.engines.embedded.lora import AdapterMerger
from miles.weights.arena import FP8_BLOCK128, SharedWeights, wait_for_writer

logger = logging.getLogger(__name__)

MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})


class EngineWeights:
    """Weight updates, LoRA adapters, the direct colocated buffer and memory release (see the module doc)."""

    def init_weight_state(self) -> None:
        """The shared weight buffer (made on the first direct update) and the LoRA merger over the base."""
        self._shared = SharedWeights(self.device)  # the shared weight buffer, once a direct update asked for it
        tied = frozenset({"lm_head.weight"}) if self.model.spec.tie_word_embeddings else frozenset()
        self.adapter = AdapterMerger(self.model.params, tied)  # LoRA: the adapter merged into the base (lora.py)
        self._repack_on_resume = False

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the live parameters; any KV computed before is re-prefilled."""
        with self.runner.lock:
            self._require_full_weights("load_weights")
            count = 0
            for name, tensor in named:
                target = self.model.weight_target(name)
                if target is None:
                    raise ValueError(
                        f"unknown weight {name!r}: not a tensor of this {self.model.spec.model_type} "
                        f"model (expected HF checkpoint names like 'model.layers.0.mlp.up_proj.weight')"
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, engine has {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                count += 1
            self.runner.invalidate_kv()
        logger.info("loaded %d tensors (weight_version still %d until set)", count, self.weight_version)

    def _require_full_weights(self, what: str) -> None:
        if not self.runner.weights_on_device:
            raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
        if self.adapter.active:
            raise ValueError(
                f"{what} refused: LoRA adapter {self.adapter.name!r} is merged into the weights; "
                "unload it first (/unload_lora_adapter) or push adapters only"
            )

    # ---- LoRA adapters (miles/engines/embedded/lora.py) --------------------------------------------------------
    def load_lora_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: dict, lora_name: str) -> None:
        """Serve this adapter from now on: its weights merged into the resident base; stale KV is re-prefilled."""
        if self.fp8:
            raise ValueError("LoRA adapters are merged into bf16 weights; this engine serves an FP8 checkpoint")
        with self.runner.lock:
            if not self.runner.weights_on_device:
                raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
            self.adapter.load(named, config, lora_name)
            self.runner.invalidate_kv()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Back to the base weights."""
        with self.runner.lock:
            if self.adapter.name != lora_name:
                raise ValueError(f"no LoRA adapter {lora_name!r} is loaded (loaded: {self.adapter.name!r})")
            if not self.runner.weights_on_device:
                raise RuntimeError("weights are released; call resume_memory_occupation(['weights']) first")
            self.adapter.unload()
            self.runner.invalidate_kv()

    def load_weights_from_dir(self, path: str) -> None:
        """Install every safetensors tensor of a HF model directory, by HF name."""
        model_type = read_config(path).get("model_type") if _has_config(path) else None
        if model_type not in (None, self.model.spec.model_type):
            raise ValueError(f"{path!r} holds a {model_type} model; this engine runs {self.model.spec.model_type}")
        self.load_weights(iter_safetensors(path))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF name -> the live tensor (an FP8 weight's e4m3 rows: what a noise fill overwrites)."""
        for name, t in self.model.params.items():
            yield name, t.q if isinstance(t, fp8.Fp8Weight) else t

    def dequantized_weights(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """HF name -> (the value the engine computes with, fp32 on its device; the largest elementwise
        distance from the value it was given, None where it is stored exactly)."""
        for name, t in self.model.params.items():
            if isinstance(t, fp8.Fp8Weight):
                dq = t.dequantize()
                yield name, dq, fp8.error_bound(dq, t.scale_inv)
            else:
                yield name, t.float(), None

    # ---- direct colocated updates (miles-only) ---------------------------------------------------------------
    def export_weight_buffer(self, generation: int | None = None, for_mapping: bool = False) -> dict:
        """Where every HF-named weight lives in the shared weight buffer (packed on first use); see
        colocated_direct.py. A caller that maps `generation` already gets `{generation, unchanged}` if
        it is current; one that will open the buffer asks `for_mapping` (on CUDA the handle comes only then,
        with the count its mapping gives back: arena.py). Refused while generating: the trainer writes without
        any engine lock."""
        self._require_quiet("export_weight_buffer")
        with self.runner.lock:
            self._require_full_weights("export_weight_buffer")
            if self._shared.arena is None:
                self._pack_weights(self.model.storage)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no engine kernel still touches the weights
            aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.model.spec.tie_word_embeddings else {}
            quantized = FP8_BLOCK128 if self.fp8 else None
            return self._shared.export(self.model.params, aliases, generation, quantized, for_mapping)

    def install_weight_buffer(
        self, generation: int, weight_version: str | int, ready_event: str | None = None
    ) -> None:
        """The trainer wrote into buffer `generation` (on CUDA its copies end at the inter-process event
        `ready_event`, waited for here): drop stale KV, take the version."""
        self._require_quiet("install_weight_buffer")
        wait_for_writer(ready_event, self.device)
        with self.runner.lock:
            self._shared.check_install(generation)
            self.runner.invalidate_kv()
        self.weight_version = int(weight_version)

    def _require_quiet(self, what: str) -> None:
        if self.scheduler is not None and not self.scheduler.paused:
            raise RuntimeError(
                f"{what} refused: generation is not paused ({self.scheduler.num_active} requests); "
                "call pause_generation first (a direct colocated update writes into the live weights)"
            )

    def _pack_weights(self, storage: dict[str, torch.Tensor | fp8.Fp8Weight]) -> None:
        """Storage -> views of one fresh flat buffer on the engine's device (copies from host if released).
        An FP8 weight's e4m3 values and block scales both go into the buffer (its `keep` rows stay apart)."""
        flat: dict[str, torch.Tensor] = {}
        for key, t in storage.items():
            if isinstance(t, fp8.Fp8Weight):
                flat[key + "\0q"], flat[key + "\0scale_inv"] = t.q, t.scale_inv
            else:
                flat[key] = t
        views = self._shared.pack(flat)
        self.model.storage = {
            key: fp8.Fp8Weight(views[key + "\0q"], views[key + "\0scale_inv"], t.keep)
            if isinstance(t, fp8.Fp8Weight)
            else views[key]
            for key, t in storage.items()
        }
        self.model.rebuild_views()  # params are views into storage
        self.runner.drop_graphs()  # captured decode graphs hold the old weight addresses

    # ---- memory -------------------------------------------------------------------------------------------
    def _tags(self, tags: list[str] | None) -> set[str]:
        chosen = set(tags) if tags else set(MEMORY_TAGS)
        unknown = chosen - MEMORY_TAGS
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; use {sorted(MEMORY_TAGS)}")
        return chosen

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags_set = self._tags(tags)
        with self.runner.lock:
            if "weights" in tags_set and self._shared.arena is not None and self.device.type == "cuda":
                # The runner moves the views to host memory; then nothing holds the flat buffer.
                self._shared.drop()
                self._repack_on_resume = True
            if "weights" in tags_set and self.reference is not None and self.device.type == "cuda":
                self.reference.release()  # its copies of the weights go too (synced again on the next scoring)
            self.runner.release(tags_set)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags_set = self._tags(tags)
        with self.runner.lock:
            if "weights" in tags_set and self._repack_on_resume and not self.runner.weights_on_device:
                self._pack_weights(self.model.storage)  # host copy -> one new device buffer, no 2x peak
                self.runner.weights_on_device = True
                self._repack_on_resume = False
            self.runner.resume(tags_set)
        if self.scheduler is not None:
            self.scheduler.wake()


def _has_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))
