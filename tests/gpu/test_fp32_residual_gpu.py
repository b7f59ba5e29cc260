"""--fp32-residual-connection on CUDA: the colocated bf16 run trains with the flag under compiled blocks and the
packed-row attention, and its train/rollout log-prob gap is below the same run's without it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from e2e_helpers import run_train  # noqa: E402

FLAGS = (
    "--hf-checkpoint", "tiny:qwen2:4x256", "--colocate", "--num-rollout", "3", "--rollout-batch-size", "8",
    "--global-batch-size", "64", "--eval-interval", "0", "--compile",
)  # fmt: skip


def _gap(rows: list[dict]) -> float:
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert len(gaps) == 3
    return sum(gaps) / len(gaps)


def test_the_flag_trains_compiled_on_cuda_and_narrows_the_gap(tmp_path):
    plain = _gap(run_train(tmp_path / "plain", *FLAGS, timeout_s=600))
    matched = _gap(run_train(tmp_path / "fp32", *FLAGS, "--fp32-residual-connection", timeout_s=600))
    print(f"train/rollout |dlogp|: bf16 stream {plain:.3e}, fp32 stream {matched:.3e}")
    assert matched < plain, (matched, plain)
