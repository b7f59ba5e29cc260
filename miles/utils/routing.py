"""Routed experts (R3): the layout they travel in, and the narrow integer type they are carried in.

An array of routed experts holds, for every token of a sequence but the last, the top-k expert ids
the engine's router chose at each MoE layer: [len(tokens) - 1, moe_layers, k] (row t: the forward of
token t, which predicts token t + 1; the last token is never fed). SGLang returns it in
`meta_info["routed_experts"]`, base64 of int32 in that layout (rows from `routed_experts_start_len`).
Past that HTTP hop miles carries it in the smallest unsigned type that holds an expert id (uint8 for
<= 256 experts: a quarter of the int32 bytes), in Samples, the buffer, the train batch, the trainer.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts, uint16 up to 65,536, else int32."""
    if num_experts <= 0:
        raise ValueError(f"num_experts={num_experts}: routing needs a mixture-of-experts model")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def encode_sglang(routed: np.ndarray) -> str:
    """SGLang's wire form: base64 of the int32 bytes (the shape travels apart: layers and k are the model's)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=np.int32).tobytes()).decode("ascii")


def decode_sglang(encoded: str, num_layers: int, topk: int, num_experts: int) -> np.ndarray:
    """[rows, num_layers, topk] in `routing_dtype(num_experts)` from SGLang's base64 int32; raises on a
    length that is not a whole number of rows or an id outside [0, num_experts)."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_row = num_layers * topk
    if per_row <= 0 or flat.size % per_row:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a whole number of rows of {num_layers} layers x top-{topk}; "
            "the engine serves another model than the trainer's"
        )
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"routed_experts has ids outside [0, {num_experts}): {int(flat.min())}..{int(flat.max())}")
    return flat.astype(routing_dtype(num_experts)).reshape(-1, num_layers, topk)


def routing_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> tuple[int, int]:
    """(bytes miles carries, bytes of Miles' int32 layout) per routed token."""
    return num_layers * topk * routing_dtype(num_experts).itemsize, num_layers * topk * 4


def pack_routing(routed: np.ndarray) -> dict:
    """A plain-data form (JSON, msgpack, torch.save(weights_only)) of a routing array: base64 of its bytes."""
    return {
        "dtype": routed.dtype.name,
        "shape": list(routed.shape),
        "b64": base64.b64encode(np.ascontiguousarray(routed).tobytes()).decode("ascii"),
    }


def unpack_routing(packed: dict | np.ndarray | None) -> np.ndarray | None:
    """The array `pack_routing` packed (an array or None passes through)."""
    if packed is None or isinstance(packed, np.ndarray):
        return packed
    flat = np.frombuffer(base64.b64decode(packed["b64"]), dtype=np.dtype(packed["dtype"]))
    return flat.reshape(packed["shape"]).copy()


@dataclass(frozen=True, slots=True)
class RoutingShape:
    """What decoding a model's routed experts needs: its MoE layer count, top-k and expert count."""

    moe_layers: int
    topk: int
    num_experts: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> RoutingShape | None:
        """From a HF config.json's dict (qwen3_moe / qwen2_moe keys); None for a dense model. MoE layers are those
        not in `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step`, as transformers builds them."""
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if not experts:
            return None
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        layers = sum(1 for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        return cls(moe_layers=layers, topk=int(cfg["num_experts_per_tok"]), num_experts=int(experts))

    def decode(self, encoded: str) -> np.ndarray:
        return decode_sglang(encoded, self.moe_layers, self.topk, self.num_experts)


def routing_shape(model_dir: str) -> RoutingShape:
    """The RoutingShape of the HF model in `model_dir`; ValueError for a dense model."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shape = RoutingShape.from_hf_config(cfg)
    if shape is None:
        raise ValueError(f"{model_dir} holds a dense {cfg.get('model_type', '?')} model: it routes no experts")
    return shape
