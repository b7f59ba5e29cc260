"""--train-backend megatron on GPUs: log-probs against FSDP and HF, one step against FSDP, TP/PP against TP=1,
checkpoint resume, offload, and a short colocated RL run.

Every check runs its ranks in fresh processes (megatron-core's parallel state is per process). The model
is `MILES_GPU_MODEL` (a HF directory, e.g. SmolLM2-135M-Instruct) or a 4-layer tiny Qwen2 made here.
Figures are printed as `MEGATRON_GPU {...}` lines (run pytest with -s to see them).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from _trainer_harness import configs, free_port  # noqa: E402
from harness import run_train  # noqa: E402

from miles.rollout.train_data import TrainBatch  # noqa: E402

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    if os.environ.get("MILES_GPU_MODEL"):
        return os.environ["MILES_GPU_MODEL"]
    from miles.models.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("megatron") / "qwen2"
    return make_tiny_model(
        str(path), arch="qwen2", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, init_std=0.1
    )


def _batch(vocab: int, num_samples: int = 8, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(24, 96, size=num_samples)
    resp = np.array([rng.integers(4, s - 4) for s in seq_lens])
    n_resp = int(resp.sum())
    return TrainBatch(
        tokens=rng.integers(0, vocab, size=int(seq_lens.sum())).astype(np.int64),
        seq_lens=seq_lens.astype(np.int64),
        response_lengths=resp.astype(np.int64),
        loss_masks=(rng.random(n_resp) > 0.1).astype(np.float32),
        rewards=rng.normal(size=num_samples).astype(np.float32),
        raw_rewards=np.zeros(num_samples, np.float32),
        group_index=np.arange(num_samples) // 4,
        sample_index=np.arange(num_samples),
        truncated=np.zeros(num_samples, np.int8),
        rollout_log_probs=(-rng.random(n_resp) * 3).astype(np.float32),
    )


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)


def _spawn(fn, world: int, *args) -> dict:
    out = mp.Manager().dict()
    mp.spawn(_entry, args=(world, free_port(), fn, args, out), nprocs=world)
    return dict(out)


def _entry(rank: int, world: int, port: int, fn, args, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        out[rank] = fn(*args)
    finally:
        dist.destroy_process_group()


def _backend(name: str, model_dir: str, dtype: str, **train):
    from miles.trainer.backend import create_backend

    # adam_eps 1e-3: with the default 1e-8 a weight whose gradient is ~1e-8 moves by lr * g / (|g| + eps),
    # so float-order noise in a near-zero gradient moves it by up to 2 lr; a larger eps makes one step's
    # weights a well-conditioned function of the gradients, which is what the weight comparisons check
    t = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 256, "clip_grad": 1.0, "lr": 1e-4, "adam_eps": 1e-3}
    t |= train
    cfg = configs(model_dir, algo=dict(advantage_estimator="grpo"), train=t, rollout=dict(global_batch_size=8))
    cfg["model"].dtype = dtype
    be = create_backend(name, **cfg)
    be.setup()
    return be


def _hf_log_probs(model_dir: str, batch: TrainBatch, dtype: torch.dtype) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for seq, r in zip(batch.sequences(), batch.response_lengths, strict=True):
            ids = torch.from_numpy(seq).cuda().unsqueeze(0)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -int(r) - 1 : -1].float(), -1)
            out.append(logp.gather(-1, ids[0, -int(r) :, None]).squeeze(-1).cpu())
    return torch.cat(out).numpy()


def _trio(model_dir: str, dtype: str) -> dict:
    from megatron.core import parallel_state

    batch = _batch(_vocab(model_dir))
    mega = _backend("megatron", model_dir, dtype).compute_log_probs(batch)[0]
    parallel_state.destroy_model_parallel()
    fsdp = _backend("fsdp", model_dir, dtype).compute_log_probs(batch)[0]
    hf = _hf_log_probs(model_dir, batch, getattr(torch, dtype))
    out = {
        "megatron_vs_hf": float(np.abs(mega - hf).max()),
        "fsdp_vs_hf": float(np.abs(fsdp - hf).max()),
        "megatron_vs_fsdp": float(np.abs(mega - fsdp).max()),
    }
    if dtype != "float32":  # each side's rounding error against the fp32 forward: comparable, or a wrong weight
        ref = _hf_log_probs(model_dir, batch, torch.float32)
        for side, lp in (("megatron", mega), ("hf", hf)):
            out[f"{side}_vs_fp32_max"] = float(np.abs(lp - ref).max())
            out[f"{side}_vs_fp32_mean"] = float(np.abs(lp - ref).mean())
    return out


def _report(name: str, figures: dict) -> None:
    print("MEGATRON_GPU " + json.dumps({"check": name, **figures}), flush=True)


def test_log_probs_equal_fsdp_and_hf_in_fp32(model_dir):
    r = _spawn(_trio, 1, model_dir, "float32")[0]
    _report("log_probs_fp32", r)
    assert max(r.values()) <= 1e-4


def test_log_probs_in_bf16_are_reported(model_dir):
    r = _spawn(_trio, 1, model_dir, "bfloat16")[0]
    _report("log_probs_bf16", r)
    # bf16 rounding moves single tokens' log-probs by up to ~1 on either side; a wrong weight or a
    # bf16 softmax moves all of them: megatron's mean error against fp32 stays within 2x HF's own
    assert r["megatron_vs_fp32_mean"] <= 2 * r["hf_vs_fp32_mean"] + 1e-3, r


def _one_step(model_dir: str, name: str) -> dict:
    be = _backend(name, model_dir, "float32")
    before = {n: t.float().cpu() for n, t in be.named_hf_tensors(torch.float32)}
    m = be.train(_batch(_vocab(model_dir), seed=1), rollout_id=0)
    weights = {n: t.float().cpu() for n, t in be.named_hf_tensors(torch.float32)}
    moved = max(float((weights[n] - t).abs().max()) for n, t in before.items())
    if name == "megatron":
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    keys = ("train/pg_loss", "train/grad_norm", "train/entropy")
    return {"metrics": {k: m[k] for k in keys if k in m}, "weights": weights, "moved": moved}


def test_one_step_matches_fsdp(model_dir):
    mega = _spawn(_one_step, 1, model_dir, "megatron")[0]
    fsdp = _spawn(_one_step, 1, model_dir, "fsdp")[0]
    diffs = {k: abs(mega["metrics"][k] - fsdp["metrics"][k]) for k in fsdp["metrics"]}
    w = max(float((mega["weights"][n] - t).abs().max()) for n, t in fsdp["weights"].items())
    _report("one_step_vs_fsdp", {**diffs, "weights_max_diff": w, "moved_max": fsdp["moved"]})
    assert set(mega["weights"]) == set(fsdp["weights"])
    assert all(d <= 1e-4 * max(1.0, abs(fsdp["metrics"][k])) for k, d in diffs.items()), diffs
    assert fsdp["moved"] >= 1e-5 and w <= 1e-2 * fsdp["moved"], (w, fsdp["moved"])  # the step moved, identically


def _resume(model_dir: str, ckpt_dir: str) -> dict:
    be = _backend("megatron", model_dir, "bfloat16")
    vocab = _vocab(model_dir)
    be.train(_batch(vocab, seed=2), rollout_id=0)
    saved = {n: t.clone() for n, t in be.named_hf_tensors()}
    path = os.path.join(ckpt_dir, "iter_0000001")
    be.save(path, {"note": "x"})
    be.offload()
    be.onload()
    after_offload = all(torch.equal(t, saved[n]) for n, t in be.named_hf_tensors())
    be.train(_batch(vocab, seed=3), rollout_id=1)
    moved = any(not torch.equal(t, saved[n]) for n, t in be.named_hf_tensors())
    extra = be.load(ckpt_dir)
    restored = all(torch.equal(t, saved[n]) for n, t in be.named_hf_tensors())
    m = be.train(_batch(vocab, seed=3), rollout_id=1)
    return {"after_offload": after_offload, "moved": moved, "restored": restored, "extra": extra,
            "finite": bool(np.isfinite(m["train/grad_norm"]))}  # fmt: skip


def test_checkpoint_resume_and_offload_keep_weights(model_dir, tmp_path):
    r = _spawn(_resume, 1, model_dir, str(tmp_path))[0]
    _report("resume", r)
    assert r == {"after_offload": True, "moved": True, "restored": True, "extra": {"note": "x"}, "finite": True}


def _parallel(model_dir: str, tp: int, pp: int) -> dict:
    import torch.distributed as dist

    be = _backend("megatron", model_dir, "float32", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    batch = _batch(_vocab(model_dir), seed=4)
    lp = be.compute_log_probs(batch)[0]
    be.train(batch, rollout_id=0)
    weights = {n: t.cpu() for n, t in be.named_hf_tensors(torch.float32)}
    return {"log_probs": lp, "weights": weights if dist.get_rank() == 0 else None}


def _compare_to_tp1(model_dir: str, tp: int, pp: int) -> dict:
    ref = _spawn(_parallel, 1, model_dir, 1, 1)[0]
    got = _spawn(_parallel, 2, model_dir, tp, pp)
    lp = max(float(np.abs(got[r]["log_probs"] - ref["log_probs"]).max()) for r in range(2))
    w = max(float((got[0]["weights"][n] - t).abs().max()) for n, t in ref["weights"].items())
    return {"log_probs_max_diff": lp, "weights_max_diff": w}


@TWO_GPUS
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp2_and_pp2_equal_tp1(model_dir, tp, pp):
    r = _compare_to_tp1(model_dir, tp, pp)
    _report(f"tp{tp}_pp{pp}_vs_tp1", r)
    assert r["log_probs_max_diff"] <= 1e-4
    assert r["weights_max_diff"] <= 1e-5


def test_short_rl_run_colocated(model_dir, tmp_path):
    rows = run_train(
        tmp_path / "run",
        "--hf-checkpoint", model_dir, "--train-backend", "megatron", "--colocate", "--num-rollout", "3",
        "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1",
        timeout_s=900,
    )  # fmt: skip
    losses = [r["train/pg_loss"] for r in rows if "train/pg_loss" in r]
    _report("rl_run", {"steps": len(losses), "reward": [r.get("rollout/reward_mean") for r in rows]})
    assert len(losses) == 3 and all(np.isfinite(losses))
