"""--train-backend megatron on a Qwen3-MoE (megatron-core MoE layers) on one GPU: log-probs against FSDP and HF,
one step against FSDP, R3 (routing mismatch 0, log-probs equal FSDP's replay), checkpoint resume, a short
colocated RL run with R3.

The model is `MILES_GPU_MOE_MODEL` (a HF qwen3_moe directory) or a 4-layer tiny qwen3_moe made here (4 experts,
top-2). Figures are printed as `MEGATRON_MOE_GPU {...}` lines (run pytest with -s to see them).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from harness import run_train  # noqa: E402
from test_megatron_gpu import _backend, _batch, _hf_log_probs, _spawn, _vocab  # noqa: E402

from miles.rollout.train_data import TrainBatch  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    if os.environ.get("MILES_GPU_MOE_MODEL"):
        return os.environ["MILES_GPU_MOE_MODEL"]
    from miles.models.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("megatron_moe") / "qwen3_moe"
    return make_tiny_model(
        str(path), arch="qwen3_moe", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, init_std=0.1
    )


def _report(name: str, figures: dict) -> None:
    print("MEGATRON_MOE_GPU " + json.dumps({"check": name, **figures}), flush=True)


def _with_routing(batch: TrainBatch, model_dir: str, seed: int = 0) -> TrainBatch:
    """`batch` carrying a random rollout routing: k distinct experts per routed token and layer."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    e, k, layers = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    rng = np.random.default_rng(seed)
    rows = int((batch.seq_lens - 1).sum())
    batch.routed_experts = np.argsort(rng.random((rows, layers, e)), -1)[..., :k].astype(np.uint8)
    return batch


def _destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _trio(model_dir: str) -> dict:
    batch = _batch(_vocab(model_dir))
    mega = _backend("megatron", model_dir, "float32").compute_log_probs(batch)[0]
    _destroy()
    fsdp = _backend("fsdp", model_dir, "float32").compute_log_probs(batch)[0]
    hf = _hf_log_probs(model_dir, batch, torch.float32)
    return {"megatron_vs_hf": float(np.abs(mega - hf).max()), "megatron_vs_fsdp": float(np.abs(mega - fsdp).max())}


def test_moe_log_probs_equal_fsdp_and_hf_in_fp32(moe_dir):
    r = _spawn(_trio, 1, moe_dir)[0]
    _report("log_probs_fp32", r)
    assert max(r.values()) <= 1e-4


def _step(model_dir: str, name: str, r3: bool) -> dict:
    train = {"use_rollout_routing_replay": True, "use_routing_replay": True} if r3 else {}
    be = _backend(name, model_dir, "float32", **train)
    batch = _batch(_vocab(model_dir), seed=1)
    if r3:
        batch = _with_routing(batch, model_dir)
    before = {n: t.float().cpu() for n, t in be.named_hf_tensors(torch.float32)}
    lp = be.compute_log_probs(batch)[0]  # under R3: the replayed routing's log-probs
    m = be.train(batch, rollout_id=0)
    weights = {n: t.float().cpu() for n, t in be.named_hf_tensors(torch.float32)}
    moved = max(float((weights[n] - t).abs().max()) for n, t in before.items())
    if name == "megatron":
        _destroy()
    keys = ("train/pg_loss", "train/grad_norm", "train/routing_mismatch", "train/router_rollout_mismatch")
    return {"metrics": {k: m[k] for k in keys if k in m}, "log_probs": lp, "weights": weights, "moved": moved}


@pytest.mark.parametrize("r3", [False, True])
def test_one_step_matches_fsdp(moe_dir, r3):
    mega = _spawn(_step, 1, moe_dir, "megatron", r3)[0]
    fsdp = _spawn(_step, 1, moe_dir, "fsdp", r3)[0]
    diffs = {k: abs(mega["metrics"][k] - fsdp["metrics"][k]) for k in fsdp["metrics"]}
    lp = float(np.abs(mega["log_probs"] - fsdp["log_probs"]).max())
    w = max(float((mega["weights"][n] - t).abs().max()) for n, t in fsdp["weights"].items())
    _report(f"one_step_vs_fsdp_r3_{r3}", {**mega["metrics"], **diffs, "log_probs_max_diff": lp,
                                          "weights_max_diff": w, "moved_max": fsdp["moved"]})  # fmt: skip
    assert set(mega["weights"]) == set(fsdp["weights"])
    assert lp <= 1e-4 and all(d <= 1e-4 * max(1.0, abs(fsdp["metrics"][k])) for k, d in diffs.items()), diffs
    assert fsdp["moved"] >= 1e-5 and w <= 1e-2 * fsdp["moved"], (w, fsdp["moved"])
    if r3:
        assert mega["metrics"]["train/routing_mismatch"] == 0.0
        assert mega["metrics"]["train/router_rollout_mismatch"] > 0.5  # random routing: R3 had work to do


def _resume(model_dir: str, ckpt_dir: str) -> dict:
    be = _backend("megatron", model_dir, "bfloat16")
    vocab = _vocab(model_dir)
    be.train(_batch(vocab, seed=2), rollout_id=0)
    saved = {n: t.clone() for n, t in be.named_hf_tensors()}
    be.save(os.path.join(ckpt_dir, "iter_0000001"), {"note": "x"})
    be.train(_batch(vocab, seed=3), rollout_id=1)
    moved = any(not torch.equal(t, saved[n]) for n, t in be.named_hf_tensors())
    be.load(ckpt_dir)
    restored = all(torch.equal(t, saved[n]) for n, t in be.named_hf_tensors())
    return {"moved": moved, "restored": restored}


def test_checkpoint_resume_keeps_the_experts(moe_dir, tmp_path):
    r = _spawn(_resume, 1, moe_dir, str(tmp_path))[0]
    _report("resume", r)
    assert r == {"moved": True, "restored": True}


def test_short_rl_run_with_r3(moe_dir, tmp_path):
    rows = run_train(
        tmp_path / "run",
        "--hf-checkpoint", moe_dir, "--train-backend", "megatron", "--colocate", "--num-rollout", "3",
        "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1", "--use-rollout-routing-replay",
        timeout_s=900,
    )  # fmt: skip
    mismatch = [r["train/routing_mismatch"] for r in rows if "train/routing_mismatch" in r]
    _report("rl_run_r3", {"steps": len(mismatch), "routing_mismatch": mismatch,
                          "router_rollout_mismatch": [r.get("train/router_rollout_mismatch") for r in rows]})  # fmt: skip
    assert len(mismatch) == 3 and max(mismatch) == 0.0
