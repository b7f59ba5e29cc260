"""Which models the trainer's `miles_varlen` attention serves, read from a config.json (no torch here: the
controller checks `--attn-implementation miles_varlen` against the model before any worker starts)."""

from __future__ import annotations

NAME = "miles_varlen"

# Model families whose HF attention goes through transformers' attention interface with plain causal
# attention (no soft-capping, no sinks); a sliding window is refused per config (`unsupported`).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def unsupported(config: dict) -> str | None:
    """Why `miles_varlen` cannot serve the model of this config.json (None: it can)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        return "the model uses sliding-window attention"
    if model_type == "mistral" and config.get("sliding_window"):
        return "the model uses sliding-window attention"
    return None
