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
    shape = ModelShape(num_params=1000, num_layers=2, hidden_size=8)
    # s (6 N + 12 L d s): 3 * (6000 + 192 * 3) + 5 * (6000 + 192 * 5)
    assert train_flops([3, 5], shape) == 3 * 6576 + 5 * 6960
    assert update_mfu(1e15, 2.0, 1e15, 1) == 0.5 and update_mfu(1e15, 2.0, 1e15, 2) == 0.25
    assert update_mfu(1e15, 2.0, None, 1) is None


def test_the_model_shape_counts_every_stored_tensor(tmp_path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(68))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "hidden_size": 16}))
    assert model_shape(tmp_path) == ModelShape(17, 3, 16)
    assert model_shape(tmp_path / "absent") is None


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
