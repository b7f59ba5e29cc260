"""The CPU demo with LoRA (`miles train`, 1 trainer, 1 embedded engine, adapter-only broadcast): the
reward rises while every weight update moves the adapter only, at most 2% of the model's bytes.

The demo's default model (`tiny:qwen2`) ties lm_head to the input embedding and is initialised at
std 0.02, so with the embedding, lm_head and final norm frozen its logits stay within +-1.63 (see
docs/lora_sft.md): no adapter on its linear layers can make a digit likely. The LoRA demo therefore runs the untied
`tiny:llama` with the adapter on lm_head (rank 4), which can.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from e2e_helpers import leftover_processes, run_train
from safetensors import safe_open

pytest.importorskip("peft")
STEPS = 16
RANK = 4
FLAGS = (
    "--lora-rank",
    str(RANK),
    "--lora-alpha",
    "16",
    "--target-modules",
    "lm_head",
    "--lr",
    "0.02",
    "--num-rollout",
    str(STEPS),
    "--eval-interval",
    "none",
    "--deterministic",
)


def _model_bytes(model_dir: str) -> int:
    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


def test_lora_demo_learns_moving_only_the_adapter(tmp_path):
    from miles.models.tiny import make_tiny_model

    # what `--hf-checkpoint tiny:llama:2x64` builds, here where the test can read its files
    model_dir = make_tiny_model(
        str(tmp_path / "model"), arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=1234
    )
    out = tmp_path / "run"
    rows = run_train(out, "--hf-checkpoint", model_dir, *FLAGS)
    assert not leftover_processes(str(out)), "processes of the run are still alive"
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last - first >= 0.15, f"reward did not rise with LoRA: first-4 mean {first:.3f}, last-4 mean {last:.3f}"

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    adapter_bytes = RANK * (config["hidden_size"] + config["vocab_size"]) * 4  # lora_A [r, in] + lora_B [out, r], fp32
    full_bytes = _model_bytes(model_dir)
    moved = [r["perf/update_weights_bytes"] for r in rows if "perf/update_weights_bytes" in r]
    assert len(moved) == STEPS  # one update per step, every one logged
    assert all(b == adapter_bytes for b in moved), moved
    assert adapter_bytes <= 0.02 * full_bytes, f"{adapter_bytes} adapter bytes vs {full_bytes} model bytes"
