"""An HF checkpoint as the embedded engine reads it: config.json as a `ModelSpec`, the safetensors
tensors by HF name, and the names of each decoder layer's tensors (`layer_names`), including the fused
ones the model stores (`FUSED_PARTS`)."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")


@dataclass(slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: dict) -> ModelSpec:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported by the embedded engine; "
                f"supported: {SUPPORTED_MODEL_TYPES} (use --engine sglang for others)"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported by the embedded engine; only 'default'")
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        num_experts = (cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if model_type == "qwen3_moe" else 0
        moe_layers: tuple[int, ...] = ()
        if num_experts:
            step = cfg.get("decoder_sparse_step", 1)
            dense = set(cfg.get("mlp_only_layers", []))
            moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob")),
            moe_layers=moe_layers,
        )


def read_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no config.json in model_path={model_path!r}; pass a HF model directory")
    with open(path) as f:
        return json.load(f)


def iter_safetensors(model_path: str, device: str = "cpu"):
    """Yield (hf_name, tensor) for every tensor of every *.safetensors file in `model_path`."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path!r}; save the model with safe_serialization")
    for file in files:
        with safe_open(file, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


FUSED_PARTS = {"qkv": ("q", "k", "v"), "qkv_b": ("qb", "kb", "vb"), "gate_up": ("gate", "up")}


def layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        k: p + v
        for k, v in {
            "ln1": "input_layernorm.weight",
            "ln2": "post_attention_layernorm.weight",
            "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight",
            "o": "self_attn.o_proj.weight",
            "qb": "self_attn.q_proj.bias",
            "kb": "self_attn.k_proj.bias",
            "vb": "self_attn.v_proj.bias",
            "ob": "self_attn.o_proj.bias",
            "qn": "self_attn.q_norm.weight",
            "kn": "self_attn.k_norm.weight",
            "gate": "mlp.gate_proj.weight",
            "up": "mlp.up_proj.weight",
            "down": "mlp.down_proj.weight",
            "router": "mlp.gate.weight",
            "experts_gate_up": "mlp.experts.gate_up_proj",
            "experts_down": "mlp.experts.down_proj",
            "qkv": "self_attn.[qkv].weight",
            "qkv_b": "self_attn.[qkv].bias",
            "gate_up": "mlp.[gate_up].weight",
        }.items()
    }


def check_params(spec: ModelSpec, params: dict[str, torch.Tensor]) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        required.append("lm_head.weight")
    for i in range(spec.num_layers):
        names = layer_names(i)
        required += [names[k] for k in ("ln1", "ln2", "q", "k", "v", "o")]
        required += [names["router"]] if i in spec.moe_layers else [names["gate"], names["up"], names["down"]]
    missing = [n for n in required if n not in params]
    if missing:
        raise ValueError(
            f"checkpoint is missing tensors {missing[:5]}; is it a complete HF {spec.model_type} causal-LM checkpoint?"
        )
