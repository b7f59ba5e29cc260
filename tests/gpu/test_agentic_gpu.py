"""The calculator environment through the session server with SmolLM2-135M-Instruct on one GPU.

A short colocated run of `launch/configs/smollm2_calculator_gpu.yaml` (3 steps, 8 prompts x 4):
real decoding, real stop tokens, the chatml family's tool-call parsing on the model's own output.
The checks are those of the CPU run: every step trained, trajectories are multi-turn where the model
did not answer at once, only the model's tokens are trained on, and the trainer's log-probs agree
with the engine's on exactly those tokens (bf16: within 0.1 nats on average; a mask shifted by one
token would be off by several nats). The 30-step learning run is `bench/gpu_matrix.py --runs
smollm2_calculator_colocate`.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from harness import REPO, run_train  # noqa: E402

try:
    from miles.recipes import smollm2

    smollm2.find_gguf()
except FileNotFoundError as e:
    pytest.skip(f"SmolLM2 GGUF not available: {e}", allow_module_level=True)


def test_smollm2_calculator_agent_runs_through_the_session_server(tmp_path):
    rows = run_train(
        tmp_path / "run",
        "--colocate",
        "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--eval-interval", "0",
        timeout_s=900,
        config=REPO / "launch/configs/smollm2_calculator_gpu.yaml",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert 1.0 <= row["rollout/turns_mean"] <= 4.0
        assert 0.0 < row["rollout/model_token_frac"] <= 1.0
        assert row["train/train_rollout_logprob_abs_diff"] < 0.1
        assert math.isfinite(row["train/loss"])
    assert any(row["rollout/model_token_frac"] < 1.0 for row in rows)  # some episode had a reminder or a tool turn
