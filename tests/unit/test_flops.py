"""perf/train/mfu's FLOPs count (the train bench's formula) and the per-phase peak memory (CUDA only)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from miles.trainer.flops import ModelShape, model_shape, train_flops, update_mfu
from miles.utils.peak_memory import phase_peak


def test_train_flops_counts_each_sequence_with_its_own_attention_length() -> None:
    shape = ModelShape(body_params=1000, num_layers=2, hidden_size=8)
    # s (6 N + 12 L d s): 3 * (6000 + 192 * 3) + 5 * (6000 + 192 * 5)
    assert train_flops([3, 5], shape) == 3 * 6576 + 5 * 6960
    assert update_mfu(1e15, 2.0, 1e15, 1) == 0.5 and update_mfu(1e15, 2.0, 1e15, 2) == 0.25
    assert update_mfu(1e15, 2.0, None, 1) is None


def test_the_head_is_charged_for_the_rows_that_compute_logits_only() -> None:
    shape = ModelShape(body_params=1000, num_layers=2, hidden_size=8, head_params=100)
    body = 3 * 6576 + 5 * 6960
    assert train_flops([3, 5], shape) == body + 6 * 100 * 8  # every position by default
    assert train_flops([3, 5], shape, head_rows=[1, 2]) == body + 6 * 100 * 3


def _write_checkpoint(path, tensors: dict[str, list[int]], config: dict) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (path / "config.json").write_text(json.dumps(config))


def test_the_model_shape_takes_the_vocabulary_matrix_once_as_the_head(tmp_path) -> None:
    cfg = {"num_hidden_layers": 3, "hidden_size": 4, "vocab_size": 10}
    body = {"layers.0.proj.weight": [4, 3], "layers.0.norm.weight": [5]}
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    tied.mkdir(), untied.mkdir()
    _write_checkpoint(tied, {"embed_tokens.weight": [10, 4], **body}, cfg)
    _write_checkpoint(untied, {"embed_tokens.weight": [10, 4], "lm_head.weight": [10, 4], **body}, cfg)
    # the embedding is a lookup: an untied model multiplies by one vocabulary matrix, as a tied one does
    assert model_shape(tied) == model_shape(untied) == ModelShape(17, 3, 4, 40)
    assert model_shape(tmp_path / "absent") is None


def test_routed_experts_count_their_active_share(tmp_path) -> None:
    cfg = {"num_hidden_layers": 1, "hidden_size": 4, "vocab_size": 10, "num_experts": 8, "num_experts_per_tok": 2}
    tensors = {
        "embed_tokens.weight": [10, 4],
        "layers.0.mlp.gate.weight": [8, 4],  # the router: every token
        "layers.0.mlp.experts.gate_up_proj": [8, 4, 6],  # fused experts: 2 of 8 per token
        "layers.0.mlp.experts.0.down_proj.weight": [4, 3],  # per-expert layout
    }
    _write_checkpoint(tmp_path, tensors, cfg)
    assert model_shape(tmp_path) == ModelShape(32 + (192 + 12) // 4, 1, 4, 40)


def test_phase_peaks_are_absent_off_cuda_and_the_largest_phase_wins_on_cuda() -> None:
    metrics: dict[str, float] = {}
    with phase_peak("cpu", "update", metrics):
        np.zeros(10)
    assert metrics == {}
    if not torch.cuda.is_available():
        pytest.skip("the peak itself needs CUDA")
    with phase_peak("cuda", "update", metrics):
        x = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        del x
    with phase_peak("cuda", "update", metrics):
        pass
    assert metrics["perf/peak_mem_gb/update"] >= 0.25
